"""What the sampler is told of one rolled-out group, built from the step's `Group`: its arm, the prompt's
index, the scored members' rewards and their generated tokens, and the JSON form a run's checkpoint keeps
of feedback not delivered yet. Owns no sampling rule (`samplers.py` does)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from posttrain.curriculum.arms import Arm

if TYPE_CHECKING:
    from posttrain.types import Group


class GroupFeedback(NamedTuple):
    """One group as the sampler hears of it (`record_prompt(arm, prompt, rewards)`, and `update`'s rewards
    and tokens per arm)."""

    arm: Arm
    prompt: int
    rewards: list[float]
    generated_tokens: int

    @classmethod
    def of(cls, group: Group) -> GroupFeedback:
        """The feedback of `group`'s scored members (infrastructure failures are not heard)."""
        scored = group.scored
        return cls(group.arm, group.prompt, [t.reward for t in scored], sum(t.num_generated for t in scored))

    def to_json(self) -> list:
        """`[arm key, prompt, rewards, generated tokens]`, as checkpoints store it."""
        arm, prompt, rewards, tokens = self
        return [arm.key, prompt, rewards, tokens]

    @classmethod
    def from_json(cls, row: list, arms: dict[str, Arm]) -> GroupFeedback:
        """The inverse of `to_json`, with the arm looked up among the run's `arms` (by key)."""
        key, prompt, rewards, tokens = row
        return cls(arms[key], prompt, rewards, tokens)
