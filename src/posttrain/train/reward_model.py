"""Reward models: a causal LM's decoder with a scalar score head (`RewardModel`), and its Bradley-Terry
training on (chosen, rejected) token sequences (`RewardLearner`).

The model is a transformers `*ForSequenceClassification` with num_labels=1, so an exported folder
loads with `AutoModelForSequenceClassification`; it scores a sequence at its last token that is not
the pad token, the rule that class applies. Sequences are token ids laid out as the RL loop lays out a
trajectory (rendered prompt, then the response and its EOS). Where pairs come from is the caller's.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.algos import bradley_terry
from posttrain.config import BatchConfig, TrainerConfig
from posttrain.train.batch import make_inputs, plan_micro_batches
from posttrain.train.forward import causal_lm, decoder_hidden
from posttrain.train.optim import lr_factor, make_adamw

TRAINER_STATE = "reward_trainer.pt"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of a tokenizer's vocabulary: two models whose fingerprints match read the same ids."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def score_positions(token_ids: Tensor, lengths: Tensor, pad_id: int) -> Tensor:
    """[B] index of each row's last token (within its length) whose id is not `pad_id`; a row of pad
    tokens only reads its last position."""
    width = token_ids.shape[1]
    pos = torch.arange(width, device=token_ids.device).expand_as(token_ids)
    real = (pos < lengths[:, None]) & (token_ids != pad_id)
    idx = torch.where(real, pos, torch.full_like(pos, -1)).max(dim=1).values
    return torch.where(idx < 0, lengths - 1, idx)


class RewardModel(nn.Module):
    """A `*ForSequenceClassification` (num_labels=1) scored on the project's model inputs (padded or
    packed rows); `hf` is the transformers model that `save_pretrained` exports."""

    def __init__(self, hf: Any) -> None:
        super().__init__()
        if int(hf.config.num_labels) != 1:
            raise ValueError(
                f"a reward model has one output (num_labels=1); this classifier has {hf.config.num_labels}"
            )
        self.hf = hf
        self.decoder = getattr(hf, hf.base_model_prefix)
        self.head = hf.score
        self.pad_id = int(hf.config.pad_token_id if hf.config.pad_token_id is not None else 0)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, token_ids: Tensor, lengths: Tensor, packed: bool = False) -> Tensor:
        """[B] float32 scores of right-padded `[B, L]` rows."""
        inputs = make_inputs(token_ids, lengths, packed, self.pad_id)
        hidden = decoder_hidden(self.decoder, inputs)
        at = inputs.flat_offset + score_positions(token_ids, lengths, self.pad_id)
        h = hidden.reshape(-1, hidden.shape[-1])[at]
        return self.head(h.to(self.head.weight.dtype)).squeeze(-1).float()

    @torch.no_grad()
    def score(self, sequences: list[list[int]], micro_batch_tokens: int = 4096) -> list[float]:
        """Scores of token sequences, in order, by padded micro-batches of at most `micro_batch_tokens`."""
        out = [0.0] * len(sequences)
        for rows in plan_micro_batches([len(s) for s in sequences], micro_batch_tokens, False):
            ids, lengths = pad_rows([sequences[i] for i in rows], self.device)
            for i, v in zip(rows, self(ids, lengths).tolist(), strict=True):
                out[i] = float(v)
        return out

    def save(self, out: str | Path, tokenizer: Any) -> Path:
        """The model and `tokenizer` as a HF folder, atomically (AutoModelForSequenceClassification loads it)."""
        from posttrain.models.loading import quiet_transformers, save_hf_folder_atomically

        with quiet_transformers():
            return save_hf_folder_atomically(self.hf, tokenizer, Path(out))


def pad_rows(sequences: list[list[int]], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Right-padded `[B, L]` ids (0 after each row) and `[B]` lengths; every row needs a token."""
    if any(len(s) == 0 for s in sequences):
        raise ValueError("a reward model cannot score an empty sequence")
    lengths = [len(s) for s in sequences]
    ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return ids.to(device), torch.tensor(lengths, dtype=torch.long, device=device)


def reward_model_from_lm(lm: Any, pad_id: int | None = None) -> RewardModel:
    """A new reward model on `lm`'s decoder weights (copied) with a zero score head: every sequence
    scores 0 until it trains."""
    from transformers import AutoModelForSequenceClassification

    base = causal_lm(lm)
    config = copy.deepcopy(base.config)
    config.num_labels = 1
    config.architectures = None
    config.problem_type = "regression"
    if pad_id is not None or config.pad_token_id is None:
        config.pad_token_id = pad_id if pad_id is not None else 0
    dtype = next(base.parameters()).dtype
    hf = AutoModelForSequenceClassification.from_config(config).to(dtype)
    getattr(hf, hf.base_model_prefix).load_state_dict(base.get_decoder().state_dict())
    nn.init.zeros_(hf.score.weight)
    hf.config.architectures = [type(hf).__name__]
    hf.eval()
    return RewardModel(hf)


def new_reward_model(
    spec: str, dtype: str = "float32", seed: int = 0, pad_id: int | None = None
) -> RewardModel:
    """`reward_model_from_lm` on the causal LM of a model spec (embedded, HF folder, .gguf, tiny:...)."""
    from posttrain.models import load_policy

    return reward_model_from_lm(load_policy(spec, dtype=dtype, seed=seed), pad_id)


def load_reward_model(folder: str | Path, dtype: str | None = None) -> RewardModel:
    """A reward model from a HF folder that `RewardModel.save` (or any num_labels=1
    `*ForSequenceClassification`) wrote."""
    from transformers import AutoModelForSequenceClassification

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder}: no config.json; not a reward model folder (posttrain rm train writes one)"
        )
    kwargs = {"dtype": {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]} if dtype else {}
    from posttrain.models.loading import quiet_transformers

    with quiet_transformers():
        hf = AutoModelForSequenceClassification.from_pretrained(folder, **kwargs)
    hf.eval()
    return RewardModel(hf)


class RewardLearner:
    """Trains a `RewardModel` with the Bradley-Terry loss: AdamW at trainer.lr with its warmup and
    schedule, gradient clipping at trainer.max_grad_norm, pairs micro-batched by batch.micro_batch_tokens."""

    def __init__(
        self, model: RewardModel, trainer_cfg: TrainerConfig, batch_cfg: BatchConfig, seed: int = 0
    ) -> None:
        if trainer_cfg.lr_schedule != "constant" and trainer_cfg.lr_decay_steps <= 0:
            raise ValueError(
                f"trainer.lr_schedule={trainer_cfg.lr_schedule} needs trainer.lr_decay_steps > 0"
            )
        torch.manual_seed(seed)
        self.model = model
        self.trainer_cfg, self.batch_cfg = trainer_cfg, batch_cfg
        self.device = model.device
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_adamw(
            self.trainable, trainer_cfg.lr, tuple(trainer_cfg.betas), trainer_cfg.weight_decay
        )
        self.optimizer_steps = 0

    def _autocast(self) -> Any:
        if self.trainer_cfg.bf16_autocast:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return torch.autocast(device_type=self.device.type, enabled=False)

    def _pass(
        self, chosen: list[list[int]], rejected: list[list[int]], margin: float, backward: bool
    ) -> dict[str, float]:
        if len(chosen) != len(rejected) or not chosen:
            raise ValueError(
                f"reward pairs: need as many chosen as rejected sequences, at least one; got "
                f"{len(chosen)} and {len(rejected)}"
            )
        n = len(chosen)
        pair_len = [max(len(c), len(r)) for c, r in zip(chosen, rejected, strict=True)]
        plan = plan_micro_batches(pair_len, max(1, self.batch_cfg.micro_batch_tokens // 2), False)
        loss_sum = margin_sum = correct = chosen_sum = rejected_sum = 0.0
        for pairs in plan:
            ids, lengths = pad_rows([chosen[i] for i in pairs] + [rejected[i] for i in pairs], self.device)
            with self._autocast():
                scores = self.model(ids, lengths, self.trainer_cfg.packing)
            k = len(pairs)
            sc, sr = scores[:k], scores[k:]
            loss = bradley_terry(sc, sr, margin).sum() / n
            if backward:
                loss.backward()
            loss_sum += float(loss.item())
            margin_sum += float((sc - sr).sum().item())
            correct += float((sc > sr).sum().item())
            chosen_sum += float(sc.sum().item())
            rejected_sum += float(sr.sum().item())
        return {
            "loss": loss_sum,
            "accuracy": correct / n,
            "margin": margin_sum / n,
            "chosen_score": chosen_sum / n,
            "rejected_score": rejected_sum / n,
            "pairs": float(n),
        }

    def step(
        self, chosen: list[list[int]], rejected: list[list[int]], margin: float = 0.0
    ) -> dict[str, float]:
        """One optimizer step on the pairs (chosen[i], rejected[i]). Metrics (of the model before the
        step): loss (mean Bradley-Terry), accuracy (pairwise), margin (mean score gap), chosen_score,
        rejected_score, pairs; and grad_norm, lr, step_s, optimizer_steps."""
        t0 = time.perf_counter()
        tc = self.trainer_cfg
        lr = tc.lr * lr_factor(self.optimizer_steps, tc.warmup_steps, tc.lr_schedule, tc.lr_decay_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        try:
            out = self._pass(chosen, rejected, margin, backward=True)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, tc.max_grad_norm)
            self.optimizer.step()
        finally:
            self.model.eval()
        self.optimizer_steps += 1
        return {
            **out,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "step_s": time.perf_counter() - t0,
            "optimizer_steps": float(self.optimizer_steps),
        }

    @torch.no_grad()
    def evaluate(self, chosen: list[list[int]], rejected: list[list[int]]) -> dict[str, float]:
        """`step`'s loss, accuracy, margin and scores on the pairs, without training."""
        return self._pass(chosen, rejected, 0.0, backward=False)

    def save(self, directory: str | Path, tokenizer: Any) -> None:
        """The model as a HF folder in `directory` and the optimizer and torch RNG state beside it
        (`TRAINER_STATE`): what `load` restores to continue exactly."""
        directory = Path(directory)
        self.model.save(directory, tokenizer)
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "optimizer_steps": self.optimizer_steps,
                "torch_rng": torch.get_rng_state(),
            },
            directory / TRAINER_STATE,
        )

    def load(self, directory: str | Path) -> None:
        """Restore what `save` wrote into `directory`: the weights into this learner's model (same
        architecture), the optimizer, its step count and the torch RNG."""
        from safetensors.torch import load_file

        directory = Path(directory)
        state_file = directory / TRAINER_STATE
        weights = directory / "model.safetensors"
        if not state_file.is_file() or not weights.is_file():
            raise FileNotFoundError(
                f"{directory}: not a reward-model checkpoint (needs model.safetensors and {TRAINER_STATE})"
            )
        try:
            self.model.hf.load_state_dict(load_file(str(weights)), strict=True)
        except RuntimeError as err:
            raise ValueError(f"{weights}: does not match this reward model: {err}") from None
        state = torch.load(state_file, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer_steps = int(state["optimizer_steps"])
        torch.set_rng_state(state["torch_rng"])
