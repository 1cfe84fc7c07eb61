"""Forward passes the Learner needs: decoder hidden states, chunked token logprobs and entropy, the
full-vocabulary KL to a reference (replay distillation), values.

The LM head runs on chunks of the *selected* positions only (generated tokens), under activation
checkpointing when gradients are on, so the full `[tokens, vocab]` logits never exist at once.
Does not know about losses or optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from posttrain.train.batch import ModelInputs


def causal_lm(model: Any) -> Any:
    """The transformers CausalLM inside a peft wrapper (LoRA layers stay in place), or the model."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_hidden(decoder: nn.Module, inputs: ModelInputs) -> Tensor:
    ids = (
        {"input_ids": inputs.input_ids}
        if inputs.inputs_embeds is None
        else {"inputs_embeds": inputs.inputs_embeds}
    )
    out = decoder(
        **ids,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        use_cache=False,
    )
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def shared_prefix_hidden(decoder: nn.Module, token_ids: Tensor, lengths: Tensor, prefix: int) -> Tensor:
    """Decoder hidden states `[n, L, H]` (padded layout) of n rows whose first `prefix` tokens are the
    same, computed as ONE packed row: the prefix once, then every row's suffix back to back, with a
    mask by which a suffix token sees the whole prefix and the earlier tokens of its own suffix, and
    position ids that restart at `prefix` for each suffix. No padding is computed, and the matmuls
    see one long row (efficient) instead of n short ones. Equal to the full forward of every row up
    to float rounding, and differentiable: the prefix's activations receive the gradient of all rows.
    """
    n, width = token_ids.shape
    device = token_ids.device
    lens = [int(x) - prefix for x in lengths.tolist()]
    total = prefix + sum(lens)
    ids = torch.cat([token_ids[0, :prefix]] + [token_ids[i, prefix : prefix + lens[i]] for i in range(n)])
    seg = torch.cat(
        [torch.full((prefix,), -1, device=device)]
        + [torch.full((s,), i, device=device) for i, s in enumerate(lens)]
    )
    pos = torch.cat(
        [torch.arange(prefix, device=device)]
        + [torch.arange(prefix, prefix + s, device=device) for s in lens]
    )
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    visible = (seg[None, :] == -1) | (seg[None, :] == seg[:, None])
    inputs = ModelInputs(
        input_ids=ids[None],
        position_ids=pos[None],
        attention_mask=(causal & visible)[None, None],
        flat_offset=torch.zeros(1, dtype=torch.long, device=device),
        tokens=total,
        cells=total,
    )
    hidden = decoder_hidden(decoder, inputs)[0]  # [total, H]
    # padded layout: row i, column t < prefix -> packed t; t >= prefix -> its suffix's offset + t - prefix
    starts = torch.tensor([prefix + sum(lens[:i]) for i in range(n)], device=device)
    cols = torch.arange(width, device=device)
    src = torch.where(cols[None, :] < prefix, cols[None, :], starts[:, None] + cols[None, :] - prefix)
    src = src.clamp(max=total - 1)  # padding columns (never read) point at a valid position
    # index_select, not hidden[src]: the backward of advanced indexing with repeated indices (every row
    # reads the prefix) is index_put_(accumulate=True), whose multi-threaded CPU kernel adds in a varying
    # order, so the bf16 gradients differed in the last bits between processes; index_add_ is ordered
    return hidden.index_select(0, src.reshape(-1)).view(n, width, hidden.shape[-1])


@dataclass
class Targets:
    """Positions with a loss: row/col in `[b, L]` layout, the hidden-state index predicting them and the token."""

    rows: Tensor
    cols: Tensor
    src: Tensor  # index into hidden.view(-1, H): position col - 1 of the row
    token: Tensor


def select_targets(mask: Tensor, token_ids: Tensor, flat_offset: Tensor) -> Targets:
    rows, cols = torch.nonzero(mask > 0, as_tuple=True)
    if bool((cols == 0).any()):
        raise ValueError("a loss on token 0 is not possible: nothing predicts the first token")
    src = flat_offset[rows] + cols - 1
    return Targets(rows, cols, src, token_ids[rows, cols])


def _logprob_entropy_chunk(
    lm_head: nn.Module, h: Tensor, tokens: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    # the head runs outside autocast, in the weights' dtype: bf16 logits over a large vocabulary
    # would put errors of ~1e-2 into every logprob and so into the importance ratios
    with torch.autocast(device_type=h.device.type, enabled=False):
        logits = lm_head(h.to(lm_head.weight.dtype)).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, tokens[:, None]).squeeze(-1) - lse
    ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return lp, ent


def chunked_logprobs(
    lm_head: nn.Module, hidden: Tensor, tokens: Tensor, chunk_tokens: int, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Logprob of `tokens[i]` under softmax(lm_head(hidden[i]) / temperature), and the entropy, by chunks.

    With gradients on, each chunk is checkpointed: its logits are recomputed in backward instead of
    being kept, so peak memory holds one chunk of logits, not all of them.
    """
    lps, ents = [], []
    grad = torch.is_grad_enabled() and hidden.requires_grad
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start : start + chunk_tokens]
        t = tokens[start : start + chunk_tokens]
        if grad:
            lp, ent = checkpoint(_logprob_entropy_chunk, lm_head, h, t, temperature, use_reentrant=False)
        else:
            lp, ent = _logprob_entropy_chunk(lm_head, h, t, temperature)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(lps), torch.cat(ents)


def _forward_kl_chunk(lm_head: nn.Module, ref_head: nn.Module, h: Tensor, ref_h: Tensor) -> Tensor:
    with torch.autocast(device_type=h.device.type, enabled=False):
        logp = torch.log_softmax(lm_head(h.to(lm_head.weight.dtype)).float(), dim=-1)
        with torch.no_grad():
            ref_logp = torch.log_softmax(ref_head(ref_h.to(ref_head.weight.dtype)).float(), dim=-1)
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1)


def chunked_forward_kl(
    lm_head: nn.Module, ref_head: nn.Module, hidden: Tensor, ref_hidden: Tensor, chunk_tokens: int
) -> Tensor:
    """Per position, KL(reference || policy) over the whole vocabulary at temperature 1: the policy's
    distribution is softmax(lm_head(hidden[i])), the reference's softmax(ref_head(ref_hidden[i])) (no
    gradient). By chunks; with gradients on, each chunk is checkpointed and both heads' logits are
    recomputed in backward, so peak memory holds one chunk of each."""
    kls = []
    grad = torch.is_grad_enabled() and hidden.requires_grad
    ref_hidden = ref_hidden.detach()
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, ref_h = hidden[start : start + chunk_tokens], ref_hidden[start : start + chunk_tokens]
        if grad:
            kls.append(checkpoint(_forward_kl_chunk, lm_head, ref_head, h, ref_h, use_reentrant=False))
        else:
            kls.append(_forward_kl_chunk(lm_head, ref_head, h, ref_h))
    return torch.cat(kls) if kls else hidden.new_zeros(0, dtype=torch.float32)


class ValueModel(nn.Module):
    """A decoder backbone with a scalar head: V(state before token t) read at position t - 1."""

    def __init__(self, decoder: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.decoder = decoder
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, inputs: ModelInputs, src: Tensor) -> Tensor:
        hidden = decoder_hidden(self.decoder, inputs)
        h = hidden.reshape(-1, hidden.shape[-1])[src]
        return self.head(h).squeeze(-1).float()


def scatter_rows(values: Tensor, targets: Targets, shape: tuple[int, int]) -> Tensor:
    """Put per-target values back into a `[b, L]` matrix (zeros elsewhere), differentiably."""
    out = values.new_zeros(shape)
    return out.index_put((targets.rows, targets.cols), values)
