"""`LearnerProtocol`: what an RL run may ask of a learner, one process (`train.learner.Learner`) or a
group of ranks (`orchestrator.rl.learner_group.LearnerGroup`). The run talks only to these names; how the
step is computed, where the weights live and how ranks agree are the implementations' business.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from posttrain.train.batch import Sample
from posttrain.train.weights import WeightUpdate


@runtime_checkable
class LearnerProtocol(Protocol):
    """A learner as the RL run uses it: `train.learner.Learner` and `orchestrator.rl.learner_group.LearnerGroup`."""

    version: int  # bumps after each step; read only from outside
    lora: bool  # adapters travel alone in weight sync
    kl_ctl: Any  # the KL controller: `.value`, `.update(kl, n)`

    def step(
        self, samples: list[Sample], current_version: int | None = None, replay: list[Sample] | None = None
    ) -> dict[str, float]:
        """One RL update (prepare, then update); returns its metrics."""
        ...

    def weights(self) -> dict[str, Tensor]:
        """The policy's full HF-named weights, LoRA merged."""
        ...

    def lora_base(self) -> dict[str, Tensor]:
        """The LoRA-adapted modules' base weights, whole."""
        ...

    def lora_update(self, version: int) -> WeightUpdate:
        """The LoRA adapters as a weight update of `version`."""
        ...

    def score_tokens(self, samples: list[Sample]) -> tuple[Tensor, Tensor, Tensor]:
        """(logprobs, entropy, loss mask) at temperature 1, no grad."""
        ...

    def attach_image_store(self, store: Any) -> None:
        """Where a vision-language policy reads its rollouts' images from."""
        ...

    @property
    def image_store(self) -> Any:
        """The attached image store (None for text models)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save(self, directory: str) -> None: ...

    def offload_optimizer(self) -> None:
        """Move optimizer state off the accelerator."""
        ...

    def reload_optimizer(self) -> None:
        """Move optimizer state back onto the accelerator."""
        ...
