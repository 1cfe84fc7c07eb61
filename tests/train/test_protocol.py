"""Learner and LearnerGroup both offer every member of `LearnerProtocol`, the RL run's only view of them."""

from __future__ import annotations

import copy

from posttrain.config import ModelConfig, TrainerConfig
from posttrain.models import load_policy
from posttrain.orchestrator.rl.learner_group import LearnerGroup
from posttrain.train import Learner
from posttrain.train.protocol import LearnerProtocol

MEMBERS = [
    "step",
    "weights",
    "lora_base",
    "lora_update",
    "score_tokens",
    "attach_image_store",
    "image_store",
    "state_dict",
    "load_state_dict",
    "save",
    "offload_optimizer",
    "reload_optimizer",
]


def test_the_protocol_names_what_the_run_uses():
    declared = {name for name in vars(LearnerProtocol) if not name.startswith("_")} | set(
        LearnerProtocol.__annotations__
    )
    assert declared == set(MEMBERS) | {"version", "lora", "kl_ctl"}


def test_learner_and_learner_group_offer_every_member():
    for cls in (Learner, LearnerGroup):
        missing = [m for m in MEMBERS if not hasattr(cls, m)]
        assert missing == [], (cls.__name__, missing)


def test_a_learner_is_a_learner_protocol_and_takes_an_image_store_only_with_a_vision_tower():
    lrn = Learner(
        ModelConfig(spec="tiny:llama"), TrainerConfig(), model=copy.deepcopy(load_policy("tiny:llama"))
    )
    assert isinstance(lrn, LearnerProtocol)
    lrn.attach_image_store(object())  # a text model has no tower to read images
    assert lrn.image_store is None and lrn.version == 0 and lrn.lora is False
