"""SFT examples as training samples: a chat conversation -> token ids and a loss mask over exactly the
assistant-generated tokens, laid out the way the RL agent loop lays out a trajectory.

The RL loop's tokens are the rendered prompt, then each assistant turn as the model generates it (its
text and the end-of-turn token, the loss), then the template's glue and observations up to the next
assistant header (no loss), each piece tokenized on its own. `encode_chat` builds the same pieces
from the chat template (`models.chat`), so SFT trains the policy on the sequences RL samples from it.
Where the data comes from is the caller's (`orchestrator.sft`).
"""

from __future__ import annotations

from typing import Any

from posttrain.models.chat import render_messages
from posttrain.models.vision import ImageStore, image_inputs, with_placeholders
from posttrain.train.batch import Sample
from posttrain.types import Message, ToolSpec

ROLES = ("system", "user", "assistant", "tool")


def encode_chat(
    tokenizer: Any, messages: list[Message], tools: list[ToolSpec] | None = None
) -> tuple[list[int], list[int]]:
    """(token_ids, loss_mask) of a conversation; the mask is 1 on the tokens of every assistant turn's
    text and on the end-of-turn token (the tokenizer's EOS, the RL loop's stop token) that closes it,
    and 0 on everything else: system, user and tool turns, the template's headers and separators.
    Messages after the last assistant turn carry nothing to learn and are left out.

    Raises ValueError for a conversation without an assistant turn or one that starts with it, an
    unknown role, and a chat template that is not prefix-stable or does not end assistant turns with
    the EOS token. A vision model's image parts become its placeholder runs (`sft_sample` keeps the images)."""
    messages = with_placeholders(tokenizer, messages)
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ValueError(f"message {i}: unknown role '{m.role}' (valid roles: {', '.join(ROLES)})")
    turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
    if not turns:
        raise ValueError("the conversation has no assistant turn: there is nothing to train on")
    if turns[0] == 0:
        raise ValueError("the conversation starts with an assistant turn: it needs a prompt before it")
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("the tokenizer has no EOS token: an assistant turn's end cannot be learned")
    eos_text = tokenizer.decode([eos_id])
    tools = tools or None
    ids: list[int] = []
    mask: list[int] = []
    covered = ""  # the rendered text the ids so far stand for
    for i in turns:
        before = render_messages(tokenizer, messages[:i], tools, add_generation_prompt=True)
        through = render_messages(tokenizer, messages[: i + 1], tools, add_generation_prompt=False)
        if not before.startswith(covered) or not through.startswith(before):
            raise ValueError(
                "the chat template is not prefix-stable (rendering more messages changed earlier text), so "
                "turns cannot be tokenized one at a time as the RL loop does"
            )
        turn = through[len(before) :]
        end = turn.find(eos_text)
        if end < 0:
            raise ValueError(
                f"the chat template does not close an assistant turn with the EOS token {eos_text!r}, "
                "which the RL loop stops generation at"
            )
        glue = tokenizer.encode(before[len(covered) :], add_special_tokens=False)
        text = tokenizer.encode(turn[:end], add_special_tokens=False)
        ids += glue + text + [eos_id]
        mask += [0] * len(glue) + [1] * (len(text) + 1)
        covered = before + turn[: end + len(eos_text)]
    return ids, mask


def sft_sample(
    tokenizer: Any,
    messages: list[Message],
    tools: list[ToolSpec] | None = None,
    images: ImageStore | None = None,
) -> Sample:
    """The Learner's `Sample` of a conversation (`encode_chat`); no behaviour logprobs, reward 0. For a
    vision model the images up to the last assistant turn go into the `images` store, the sample holds
    their hashes."""
    ids, mask = encode_chat(tokenizer, messages, tools)
    keys: list[str] = []
    if image_inputs(tokenizer) is not None:
        last = max(i for i, m in enumerate(messages) if m.role == "assistant")
        parts = [img for m in messages[: last + 1] for img in m.images]
        if parts and images is None:
            raise ValueError("the conversation has images but no image store was given to keep them")
        keys = [images.put(img) for img in parts] if images is not None else []
    return Sample(ids, mask, [0.0] * len(ids), reward=0.0, group_id=0, images=keys)
