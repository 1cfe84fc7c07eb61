"""A step's groups on their way to the Learner: the members too stale to train on dropped (counted), then
one `Sample` per scored member, group by group, its images stored by content hash. Owns that conversion
only; the groups are made by the collector, what the Learner does with its samples is `train`'s."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.train import Sample
    from posttrain.types import Group


def drop_stale(groups: list[Group], version: int, max_staleness: int) -> tuple[list[Group], int]:
    """The groups with their scored members at most `max_staleness` policy versions behind `version`
    (groups left with none go), and how many scored members were dropped."""
    fresh, dropped = [], 0
    for g in groups:
        scored = g.scored
        members = [t for t in scored if version - t.policy_version <= max_staleness]
        dropped += len(scored) - len(members)
        if members:
            fresh.append(replace(g, members=members))
    return fresh, dropped


def samples_from_groups(groups: list[Group], image_store: Any = None) -> list[Sample]:
    """One Learner sample per scored member, in group order; the group id is the members' own (the
    collector's). With an `image_store` (vision policies) each image becomes its content hash there."""
    from posttrain.train import Sample

    return [
        Sample(
            token_ids=t.token_ids,
            loss_mask=t.loss_mask,
            behavior_logprobs=t.behavior_logprobs,
            reward=t.reward,
            group_id=t.group_id,
            policy_version=t.policy_version,
            routing=t.routing,
            images=[image_store.put(img) for img in t.images] if image_store is not None else [],
        )
        for g in groups
        for t in g.scored
    ]
