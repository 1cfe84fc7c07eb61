"""SFT on the Learner: the loss mask of a multi-turn tool conversation is exactly its assistant tokens
and their end-of-turn token (checked against character spans of the rendered template), micro-batching
does not change the step, the loss falls on a fixed small dataset, and bad conversations are refused."""

from __future__ import annotations

import pytest
import torch

from posttrain.config import load_config
from posttrain.models import load_tokenizer
from posttrain.models.chat import render_messages
from posttrain.train import Learner, encode_chat, sft_sample
from posttrain.types import Message, ToolSpec

CALL = '<tool_call>[{"name": "get_product", "arguments": {"sku": "A1"}}]</tool_call>'
TOOLS = [
    ToolSpec(
        "get_product",
        "look a product up",
        {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]},
    )
]
CONVERSATION = [
    Message("system", "You run a shop."),
    Message("user", "What does A1 cost?"),
    Message("assistant", CALL),
    Message("tool", '{"sku": "A1", "price": 12}', tool_call_id="call_1_0", name="get_product"),
    Message("user", "And in euros?"),
    Message("assistant", "It costs 12. <answer>12</answer>"),
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny:llama")


def _char_offsets(tok, ids: list[int]) -> list[int]:
    return [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]


def test_mask_is_exactly_the_assistant_tokens_of_a_multi_turn_tool_conversation(tok):
    ids, mask = encode_chat(tok, CONVERSATION, TOOLS)
    full = render_messages(tok, CONVERSATION, TOOLS, add_generation_prompt=False)
    # the ids spell the rendered conversation up to the last assistant turn's end-of-turn token
    assert full.endswith("<|im_end|>\n")
    assert tok.decode(ids) == full[: -len("\n")]
    # character spans of each assistant turn's text + its <|im_end|>, found in the rendered template
    spans, cursor = [], 0
    for m in CONVERSATION:
        if m.role == "assistant":
            header = "<|im_start|>assistant\n"
            at = full.index(header + m.content + "<|im_end|>", cursor) + len(header)
            spans.append((at, at + len(m.content) + len("<|im_end|>")))
            cursor = spans[-1][1]
    offsets = _char_offsets(tok, ids)
    want = [int(any(a <= offsets[k] and offsets[k + 1] <= b for a, b in spans)) for k in range(len(ids))]
    assert mask == want
    # two assistant turns, each its text's tokens and one EOS; the EOS is learned at both ends
    n_text = sum(
        len(tok.encode(m.content, add_special_tokens=False)) for m in CONVERSATION if m.role == "assistant"
    )
    assert sum(mask) == n_text + 2
    eos_positions = [k for k, i in enumerate(ids) if i == tok.eos_token_id and mask[k]]
    assert len(eos_positions) == 2 and eos_positions[-1] == len(ids) - 1
    # nothing of the system, user or tool turns (nor the tools preamble) is in the loss
    learned = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert learned == CALL + "<|im_end|>" + "It costs 12. <answer>12</answer><|im_end|>"


def test_messages_after_the_last_assistant_turn_are_left_out(tok):
    ids, mask = encode_chat(tok, CONVERSATION[:4])
    ids3, mask3 = encode_chat(tok, CONVERSATION[:3])
    assert (ids, mask) == (ids3, mask3)
    assert mask3[-1] == 1 and ids3[-1] == tok.eos_token_id


def test_conversations_that_cannot_be_trained_on_are_refused(tok):
    with pytest.raises(ValueError, match="no assistant turn"):
        encode_chat(tok, [Message("user", "hi")])
    with pytest.raises(ValueError, match="starts with an assistant turn"):
        encode_chat(tok, [Message("assistant", "hi"), Message("user", "x")])
    with pytest.raises(ValueError, match="message 1: unknown role 'robot'"):
        encode_chat(tok, [Message("user", "hi"), Message("robot", "x"), Message("assistant", "y")])


def _learner(*sets: str) -> Learner:
    cfg = load_config(None, ["model.spec=tiny:llama", *sets])
    return Learner(cfg.model, cfg.trainer, cfg.algorithm, seed=0, batch_cfg=cfg.batch)


def _examples(tok, n: int = 8):
    return [
        sft_sample(
            tok,
            [Message("user", f"What is {i} plus {i}?"), Message("assistant", f"<answer>{2 * i}</answer>")],
        )
        for i in range(n)
    ]


def test_sft_loss_falls_on_a_fixed_small_dataset(tok):
    learner = _learner("trainer.lr=1e-2")
    data = _examples(tok)
    losses = [learner.sft_step(data)["loss"] for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert learner.optimizer_steps == 15 and learner.version == 15
    # the step's reported loss is the token-mean NLL of the batch before the step
    assert learner.sft_loss(data)["loss"] < losses[-1]


def test_sft_step_is_the_same_whatever_the_micro_batches(tok):
    """In a float64 model (in float32, rounding in the attention backward differs by ~1e-3 of a tensor's
    largest gradient between one micro-batch and five), the accumulated gradients are the one batch's
    up to the LM head's float32 logits."""
    from posttrain.models import load_policy

    data = _examples(tok, 6)  # lengths 46 x 5 and 47: the whole batch pads one row
    grads, metrics = [], []
    for budget in (100000, 40):  # one micro-batch; six of one row each
        cfg = load_config(None, ["model.spec=tiny:llama", f"batch.micro_batch_tokens={budget}"])
        model = load_policy("tiny:llama").double()
        learner = Learner(cfg.model, cfg.trainer, cfg.algorithm, seed=0, model=model, batch_cfg=cfg.batch)
        metrics.append(learner.sft_step(data))
        grads.append([p.grad.clone() for p in learner.trainable])
    a, b = metrics
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert a["tokens"] == b["tokens"] == sum(sum(s.loss_mask) for s in data)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    for g1, g2 in zip(*grads, strict=True):
        assert (g1 - g2).abs().max() <= 1e-6 * g1.abs().max()


def test_sft_loss_is_the_hand_summed_nll_of_the_masked_tokens(tok):
    learner = _learner()
    data = _examples(tok, 2)
    got = learner.sft_loss(data)
    with torch.no_grad():
        total, count = 0.0, 0
        for s in data:
            logits = learner.model(input_ids=torch.tensor([s.token_ids])).logits[0].float()
            lps = torch.log_softmax(logits, -1)
            for t, m in enumerate(s.loss_mask):
                if m:
                    total -= float(lps[t - 1, s.token_ids[t]])
                    count += 1
    assert got["tokens"] == count
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)
