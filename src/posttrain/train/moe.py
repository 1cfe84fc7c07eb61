"""The Learner's Mixture-of-Experts controls over transformers' MoE models: routing replay, a frozen
router, the load-balancing and z-losses, and routing metrics.

`MoeRouting` hooks every top-k router of the policy (transformers' `*TopKRouter` modules: Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE). Inside `MoeRouting.forward(...)` each router sees which flat decoder positions are real tokens
and, with `trainer.moe.routing_replay`, the engine's expert choices for them: the router's top-k is
replaced by those experts and their weights are the router's softmax probabilities of them,
renormalised as the family does, so gradients still reach the router. Positions without a recorded
choice (a sequence's last token, padding) route freely. Does not know about rollouts or losses other
than its own two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.train.batch import Batch, ModelInputs


def routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router modules of a transformers MoE model, in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def flat_routing(batch: Batch, inputs: ModelInputs | None, prefix: int) -> tuple[Tensor, Tensor]:
    """(recorded expert ids `[N, layers, k]` with -1 where none, real-token mask `[N]`) over the N flat
    positions the decoder runs for this micro-batch: `inputs` (padded or packed rows, placed by
    flat_offset) or, with a shared prefix, the packed prefix-then-suffixes row of shared_prefix_hidden."""
    assert batch.routing is not None
    _, _, layers, k = batch.routing.shape
    valid, starts = real_positions(batch, inputs, prefix)
    forced = torch.full((valid.shape[0], layers, k), -1, dtype=torch.long, device=valid.device)
    for i, (o, n) in enumerate(zip(starts, batch.lengths.tolist(), strict=True)):
        if prefix > 0:  # row i's suffix; the prefix is row 0's
            forced[o : o + n - prefix] = batch.routing[i, prefix:n]
        else:
            forced[o : o + n] = batch.routing[i, :n]
    if prefix > 0:
        forced[:prefix] = batch.routing[0, :prefix]
    return forced, valid


def real_positions(batch: Batch, inputs: ModelInputs | None, prefix: int) -> tuple[Tensor, list[int]]:
    """(mask `[N]` of the flat decoder positions holding real tokens, where each row's tokens start:
    its token 0, or with a shared prefix its first suffix token)."""
    lens = batch.lengths.tolist()
    device = batch.token_ids.device
    if prefix > 0:
        starts = [prefix + sum(n - prefix for n in lens[:i]) for i in range(len(lens))]
        total = prefix + sum(n - prefix for n in lens)
        return torch.ones(total, dtype=torch.bool, device=device), starts
    assert inputs is not None
    valid = torch.zeros(inputs.input_ids.numel(), dtype=torch.bool, device=device)
    starts = [int(x) for x in inputs.flat_offset.tolist()]
    for o, n in zip(starts, lens, strict=True):
        valid[o : o + n] = True
    return valid, starts


def load_balancing_loss(logits: Tensor, ids: Tensor, num_experts: int) -> Tensor:
    """Switch/Mixtral auxiliary loss of one layer: E x sum_e f_e x P_e, f_e the fraction of the T x k
    (token, slot) assignments that go to expert e (`ids`, the routing used) and P_e the mean router
    probability of e; 1.0 when both are uniform."""
    probs = torch.softmax(logits.float(), dim=-1)
    counts = torch.zeros(num_experts, device=logits.device).index_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), device=logits.device)
    )
    f = counts / ids.numel()
    return num_experts * (f * probs.mean(dim=0)).sum()


def z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss of one layer: mean over tokens of logsumexp(router logits)^2."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


class MoeRouting:
    """Hooks on a policy's routers: replays recorded routing, collects the auxiliary losses of the
    forward with gradients, and accumulates routing metrics until `pop_metrics`."""

    def __init__(self, model: nn.Module, cfg: Any, gradient_checkpointing: bool = False) -> None:
        self.cfg = cfg
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(
                "trainer.moe options need a Mixture-of-Experts policy (Mixtral, Qwen2/3-MoE, OLMoE); "
                "this model has no top-k routers"
            )
        if cfg.routing_replay and gradient_checkpointing:
            raise ValueError(
                "trainer.moe.routing_replay needs trainer.gradient_checkpointing=false: the recomputed "
                "forward in backward would route freely"
            )
        self.num_experts = int(self.routers[0].num_experts)
        self.top_k = int(self.routers[0].top_k)
        if cfg.freeze_router:
            for r in self.routers:
                for p in r.parameters():
                    p.requires_grad_(False)
        self._forced: Tensor | None = None
        self._valid: Tensor | None = None
        self._losses: list[tuple[Tensor, Tensor]] = []
        self._stats: dict[str, float] = {}
        self._stat_counts: dict[str, float] = {}
        self._load = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64)
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    @classmethod
    def attach(cls, model: nn.Module, cfg: Any, gradient_checkpointing: bool = False) -> MoeRouting | None:
        """The controller for `model`: None for a dense model with every trainer.moe option off."""
        if not cfg.enabled and not routers(model):
            return None
        return cls(model, cfg, gradient_checkpointing)

    @contextlib.contextmanager
    def forward(self, batch: Batch, inputs: ModelInputs | None, prefix: int) -> Iterator[None]:
        """Route the decoder forward run inside by this micro-batch's recorded routing (when replaying;
        rows without a record, such as supervised data, route freely)."""
        if batch.routing is None:
            forced, valid = None, real_positions(batch, inputs, prefix)[0]
        else:
            forced, valid = flat_routing(batch, inputs, prefix)
        self._forced, self._valid, self._losses = forced, valid, []
        try:
            yield
        finally:
            self._forced = self._valid = None

    def check_rollouts(self, batch: Batch) -> None:
        """Refuse an RL batch without recorded routing when replay is on (it would silently route freely)."""
        if self.cfg.routing_replay and batch.routing is None:
            raise ValueError(
                "trainer.moe.routing_replay needs each rollout's expert choices (the paged engine "
                "records them for MoE models); this batch has none"
            )

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._valid is None:  # a forward outside MoeRouting.forward: leave it alone
                return None
            logits, weights, ids = output
            valid = self._valid
            free = ids
            if self._forced is not None:
                recorded = self._forced[:, layer]
                known = (recorded >= 0).all(dim=-1) & valid
                self._mismatch(layer, ids, recorded, known)
                if self.cfg.routing_replay:
                    ids = torch.where(known[:, None], recorded, ids)
                    probs = torch.softmax(logits.float(), dim=-1)
                    weights = probs.gather(-1, ids)
                    if getattr(module, "norm_topk_prob", True):  # Mixtral (no attribute) always renormalises
                        weights = weights / weights.sum(dim=-1, keepdim=True)
                    if hasattr(module, "norm_topk_prob"):  # Qwen and OLMoE cast back; Mixtral not
                        weights = weights.to(logits.dtype)
            self._observe(layer, logits[valid].detach(), ids[valid], free[valid])
            if torch.is_grad_enabled() and (self.cfg.aux_loss_coef > 0 or self.cfg.z_loss_coef > 0):
                self._losses.append((logits[valid], ids[valid]))
            return logits, weights, ids

        return hook

    def _mismatch(self, layer: int, free: Tensor, recorded: Tensor, known: Tensor) -> None:
        n = int(known.sum())
        if n == 0:
            return
        a = torch.sort(free[known], dim=-1).values
        b = torch.sort(recorded[known], dim=-1).values
        differs = (a != b).any(dim=-1).float()
        self._add("routing_mismatch", float(differs.mean()), n)
        self._add(f"routing_mismatch/layer{layer}", float(differs.mean()), n)

    @torch.no_grad()
    def _observe(self, layer: int, logits: Tensor, ids: Tensor, free: Tensor) -> None:
        if logits.shape[0] == 0:
            return
        probs = torch.softmax(logits.float(), dim=-1)
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1).mean()
        self._add("routing_entropy", float(entropy), logits.shape[0])
        self._load[layer] += torch.bincount(ids.reshape(-1), minlength=self.num_experts).double().cpu()

    def _add(self, key: str, value: float, weight: float) -> None:
        self._stats[key] = self._stats.get(key, 0.0) + value * weight
        self._stat_counts[key] = self._stat_counts.get(key, 0.0) + weight

    def loss(self) -> Tensor | None:
        """aux_loss_coef x load-balancing + z_loss_coef x z-loss, averaged over layers, of the last forward
        run with gradients inside `forward`; None when both coefficients are 0."""
        c = self.cfg
        if not self._losses or (c.aux_loss_coef == 0 and c.z_loss_coef == 0):
            return None
        aux = torch.stack([load_balancing_loss(lg, ids, self.num_experts) for lg, ids in self._losses]).mean()
        z = torch.stack([z_loss(lg) for lg, _ in self._losses]).mean()
        self._add("aux_loss", float(aux.detach()), 1.0)
        self._add("z_loss", float(z.detach()), 1.0)
        self._losses = []
        return c.aux_loss_coef * aux + c.z_loss_coef * z

    def pop_metrics(self) -> dict[str, float]:
        """Routing figures since the last call, under `moe/`: routing_entropy (nats, mean over tokens and
        layers), routing_mismatch (fraction of token-layer pairs whose learner top-k set differs from the
        engine's; and per layer), load/layer{l} (the busiest expert's share of layer l's assignments over
        the balanced share 1/E: 1.0 is balanced, E is one expert taking all), load/expert{e} (expert e's
        share over all layers), aux_loss and z_loss (unweighted)."""
        out = {f"moe/{k}": v / self._stat_counts[k] for k, v in self._stats.items() if self._stat_counts[k]}
        load = self._load
        for layer in range(load.shape[0]):
            total = float(load[layer].sum())
            if total:
                out[f"moe/load/layer{layer}"] = float(load[layer].max()) / total * self.num_experts
        if float(load.sum()):
            share = load.sum(dim=0) / load.sum()
            out.update({f"moe/load/expert{e}": float(share[e]) for e in range(self.num_experts)})
            out["moe/load_max"] = max(v for k, v in out.items() if k.startswith("moe/load/layer"))
        self._stats, self._stat_counts = {}, {}
        self._load.zero_()
        return out
