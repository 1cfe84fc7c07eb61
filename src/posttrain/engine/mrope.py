"""M-RoPE (multimodal rotary embedding, Qwen2-VL / Qwen2.5-VL) in the paged engine: which rotary
columns take the temporal, height and width component of a 3-D position, the cos/sin rows of 3-D
positions from the engine's 1-D tables, and a prompt's positions from its model family.

A text token's three components are equal, so its row is the ordinary table row at that position;
only image placeholder rows need `mrope_rows`. The positions themselves are the family's
(`models/qwen2_vl.py`); does not schedule or preprocess images.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.engine.types import BadRequestError
from posttrain.longctx.rope import rope_parameters
from posttrain.models.vision import ImageInputs
from posttrain.types import ContentError, ImagePart

MROPE_MODEL_TYPES = ("qwen2_vl_text", "qwen2_5_vl_text")
_DEFAULT_SECTIONS = (16, 24, 24)  # transformers' Qwen2-VL rotary default when the config names none


def mrope_columns(config: Any, head_dim: int) -> torch.Tensor | None:
    """`[head_dim]` component (0 temporal, 1 height, 2 width) of each rotary column, as transformers'
    `mrope_section` splits the frequencies (both halves alike); None for a model without M-RoPE."""
    sections = rope_parameters(config).get("mrope_section")
    if not sections:
        if getattr(config, "model_type", None) not in MROPE_MODEL_TYPES:
            return None
        sections = _DEFAULT_SECTIONS
    if sum(sections) != head_dim // 2:
        raise ValueError(
            f"mrope_section {list(sections)} covers {sum(sections)} rotary frequencies; the head "
            f"dimension {head_dim} has {head_dim // 2}"
        )
    half = torch.repeat_interleave(torch.arange(len(sections)) % 3, torch.tensor(sections))
    return torch.cat([half, half])


def mrope_rows(table: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """`[k, head_dim]` rows of a cos or sin `table` for 3-D `positions` `[3, k]`: each column read at
    the position of its component."""
    k = positions.shape[1]
    rows = table.index_select(0, positions.reshape(-1)).view(3, k, -1)
    return rows.gather(0, columns.view(1, 1, -1).expand(1, k, -1))[0]


def prompt_rope(
    inputs: ImageInputs, length: int, placeholders: list[int], images: list[ImagePart]
) -> tuple[torch.Tensor, int]:
    """The prompt's M-RoPE positions `[3, length]` and rope delta from its model family;
    BadRequestError when the images or their placeholder runs do not fit the family's layout."""
    try:
        rope = inputs.family.rope_positions(inputs, length, placeholders, images)
    except (ContentError, ValueError) as err:
        raise BadRequestError(f"the prompt's image runs: {err}") from None
    if rope is None:
        raise ValueError(f"the model uses M-RoPE, but the {inputs.family.name} family gives no 3-D positions")
    return rope
