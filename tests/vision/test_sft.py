"""Supervised alignment with images: JSONL rows with PNG data-URL parts, the chat encoding with the
placeholder runs, the sample's images by hash, and the Learner's SFT loss equal to transformers'
cross-entropy on the assistant tokens (each tiny VLM family); bad image parts name the line."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.config import AlgorithmConfig, ModelConfig, TrainerConfig
from posttrain.models.vision import ImageStore, image_inputs
from posttrain.orchestrator.offline.sft import SFTDataError, parse_row
from posttrain.train import Learner, sft_sample
from posttrain.types import ImagePart

from .helpers import noise_image


def _row(img: ImagePart) -> dict:
    content = [
        {"type": "text", "text": "How many shapes?"},
        {"type": "image_url", "image_url": {"url": img.data_url()}},
    ]
    return {
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": "<answer>3</answer>"},
        ]
    }


def test_sft_loss_with_images_equals_transformers(vlm):
    model, tok = vlm
    img = noise_image(6)
    ex = parse_row(_row(img), "data.jsonl:1")
    assert ex.messages[0].images[0].png == img.png
    store = ImageStore()
    sample = sft_sample(tok, ex.messages, images=store)
    vis = image_inputs(tok)
    assert sample.images == [img.sha256] and img.sha256 in store
    assert sample.token_ids.count(vis.image_token_id) == vis.run_length
    learner = Learner(
        ModelConfig(spec=f"tiny:{vis.family.name}"),
        TrainerConfig(),
        AlgorithmConfig(),
        model=copy.deepcopy(model),
    )
    learner.vision.store = store
    got = learner.sft_loss([sample])
    ids = torch.tensor([sample.token_ids])
    with torch.inference_mode():
        logits = model(input_ids=ids, **vis.hf_inputs([img])).logits[0].float()
    mask = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
    nll = torch.nn.functional.cross_entropy(logits[:-1][mask], ids[0, 1:][mask])
    assert got["tokens"] == float(mask.sum()) and got["loss"] == pytest.approx(float(nll), abs=1e-5)
    with pytest.raises(ValueError, match="no image store"):
        sft_sample(tok, ex.messages)


def test_bad_image_parts_in_sft_data_name_the_line():
    row = _row(noise_image(0))
    row["messages"][0]["content"][1]["image_url"]["url"] = "data:image/png;base64,!!"
    with pytest.raises(SFTDataError, match=r"data.jsonl:7: message 0: content\[1\]: invalid base64"):
        parse_row(row, "data.jsonl:7")
    row = _row(noise_image(0))
    row["messages"][1]["content"] = row["messages"][0]["content"]
    with pytest.raises(SFTDataError, match="an assistant message cannot hold images"):
        parse_row(row, "data.jsonl:2")
