"""Models: tiny families forward and generate; the embedded default loads from its cache, renders its
chat template and generates deterministically; missing models say how to get them."""

from __future__ import annotations

import time

import pytest
import torch

from posttrain.models import ModelNotFoundError, load_policy, load_tokenizer, render_messages, resolve
from posttrain.models.loading import ensure_embedded
from posttrain.types import Message, ToolSpec


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiny_forward_and_generate(family):
    model = load_policy(f"tiny:{family}", seed=0)
    tok = load_tokenizer(f"tiny:{family}")
    ids = torch.tensor([tok.encode("hello world")])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 5)


def test_tiny_is_deterministic_from_seed():
    a = load_policy("tiny:llama", seed=1).state_dict()
    b = load_policy("tiny:llama", seed=1).state_dict()
    c = load_policy("tiny:llama", seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_embedded_default_loads_fast_from_cache_and_generates_deterministically():
    folder = ensure_embedded()  # converts on first use (about 20 s), then cached
    mtime = (folder / "model.safetensors").stat().st_mtime
    t0 = time.perf_counter()
    model = load_policy("smollm2-135m")
    tok = load_tokenizer("smollm2-135m")
    load_s = time.perf_counter() - t0
    assert (folder / "model.safetensors").stat().st_mtime == mtime  # reused, not rewritten
    assert load_s < 5.0, f"loading from the cache took {load_s:.1f} s"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    text = render_messages(tok, [Message("user", "What is 2+3?")])
    assert text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    outs = [
        model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist() for _ in range(2)
    ]
    assert outs[0] == outs[1]
    assert "5" in tok.decode(outs[0])


def test_tools_are_rendered_into_the_system_message_for_smollm2():
    tok = load_tokenizer("tiny:llama")
    tool = ToolSpec(
        "get_weather", "Weather for a city", {"type": "object", "properties": {"city": {"type": "string"}}}
    )
    text = render_messages(tok, [Message("user", "Weather in Paris?")], tools=[tool])
    assert text.startswith("<|im_start|>system\nYou are an expert in composing functions.")
    assert '"name": "get_weather"' in text and "<tool_call>[" in text


def test_missing_models_say_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(ModelNotFoundError, match="run `posttrain models pull org/some-hub-model`"):
        resolve("org/some-hub-model")  # a Hub id the cache lacks, offline (tests/foundation/test_hub.py)
    with pytest.raises(ModelNotFoundError, match="or a Hub id ORG/NAME"):
        resolve("no-such-model")
    with pytest.raises(ModelNotFoundError, match="unknown tiny family 'gpt9'"):
        resolve("tiny:gpt9")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve(str(tmp_path))
