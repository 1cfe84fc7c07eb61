"""A step's typed groups: what the sampler hears of a group, which members are too stale to train on, the
Learner's samples built from groups, and a RunState's JSON round trip."""

from __future__ import annotations

from posttrain.curriculum import Arm, GroupFeedback
from posttrain.orchestrator.rl.groups import drop_stale, samples_from_groups
from posttrain.orchestrator.rl.state import COUNTERS, RunState
from posttrain.types import Group, Task, Trajectory, TrajectoryStatus

TASK = Task(id="t0", domain="math", difficulty=0, prompt=[])
ARM = Arm("math", 0)


def _traj(reward: float, generated: int, version: int = 0, gid: int = 7, status=TrajectoryStatus.OK):
    n = 2 + generated
    mask = [0, 0] + [1] * generated
    return Trajectory(
        task=TASK,
        token_ids=list(range(n)),
        loss_mask=mask,
        behavior_logprobs=[-0.5 * m for m in mask],
        prompt_len=2,
        reward=reward,
        policy_version=version,
        status=status,
        group_id=gid,
    )


def test_feedback_hears_the_scored_members_only():
    group = Group(
        TASK,
        ARM,
        3,
        7,
        [_traj(1.0, 4), _traj(0.0, 6, status=TrajectoryStatus.SANDBOX_ERROR), _traj(0.5, 5)],
    )
    assert len(group.scored) == 2
    assert GroupFeedback.of(group) == (ARM, 3, [1.0, 0.5], 9)
    assert GroupFeedback.of(group).to_json() == ["math:0", 3, [1.0, 0.5], 9]
    assert GroupFeedback.from_json(["math:0", 3, [1.0, 0.5], 9], {"math:0": ARM}) == GroupFeedback.of(group)


def test_stale_members_are_dropped_and_counted_and_an_emptied_group_goes():
    a = Group(TASK, ARM, 0, 0, [_traj(1.0, 3, version=3, gid=0), _traj(0.0, 3, version=4, gid=0)])
    b = Group(TASK, ARM, 1, 1, [_traj(1.0, 3, version=2, gid=1)])
    c = Group(TASK, ARM, 2, 2, [_traj(0.0, 3, version=5, gid=2, status=TrajectoryStatus.ENGINE_ERROR)])
    fresh, dropped = drop_stale([a, b, c], version=5, max_staleness=1)
    assert dropped == 2  # a's version-3 member and b's only member; c's failure was never scored
    assert [(g.group_id, [t.policy_version for t in g.members]) for g in fresh] == [(0, [4])]


def test_samples_come_group_by_group_with_the_members_group_ids():
    groups = [
        Group(TASK, ARM, 0, 4, [_traj(1.0, 2, gid=4), _traj(0.0, 3, gid=4)]),
        Group(
            TASK,
            ARM,
            1,
            5,
            [_traj(0.5, 1, gid=5, status=TrajectoryStatus.REWARD_ERROR), _traj(0.25, 1, gid=5)],
        ),
    ]
    samples = samples_from_groups(groups)
    assert [(s.group_id, s.reward, len(s.token_ids), s.images) for s in samples] == [
        (4, 1.0, 4, []),
        (4, 0.0, 5, []),
        (5, 0.25, 3, []),
    ]


def test_run_state_json_round_trip_keeps_the_held_back_feedback():
    state = RunState(
        step=2,
        learner_version=2,
        engine_version=2,
        cursors={"math:0": 3},
        seen_prompts={"math:0": [0, 1, 2]},
        counters=dict(COUNTERS, rollout_tokens=120.0),
        sampler={"stats": {}},
        sampler_pending=[(1, [GroupFeedback(ARM, 0, [1.0, 0.0], 10)])],
        python_random=[3, [1, 2], None],
        numpy_random=["MT19937", [1, 2], 0, 0, 0.0],
    )
    data = state.to_json()
    assert data["sampler_pending"] == [[1, [["math:0", 0, [1.0, 0.0], 10]]]]
    assert RunState.from_json(data, [ARM]) == state
    older = {k: v for k, v in data.items() if k != "sampler_pending"}
    older["counters"] = {"rollout_tokens": 120.0}  # written before the other counters existed
    assert RunState.from_json(older, [ARM]).counters == state.counters
    assert RunState.from_json(older, [ARM]).sampler_pending == []
