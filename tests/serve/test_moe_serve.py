"""Serving an MoE folder (an upcycled tiny model, a saved tiny OLMoE) through `load_entries` -- the path
`posttrain serve` takes -- in standard and fast mode, with the real `openai` client against a live server."""

from __future__ import annotations

import openai

from posttrain.config import load_config
from posttrain.engine import GenerationRequest, SamplingParams
from posttrain.models import encode_messages, load_policy, load_tokenizer
from posttrain.models.loading import save_hf_folder_atomically
from posttrain.models.upcycle import upcycle_to_folder
from posttrain.serve import ServeSettings, ServeState
from posttrain.serve.server import load_entries, resolve_source
from serve.conftest import start_server

HI = [{"role": "user", "content": "Say hello."}]


def test_an_upcycled_moe_folder_serves_standard_and_fast(tmp_path):
    folder, _ = upcycle_to_folder("tiny:llama", tmp_path / "moe", experts=4, top_k=2)
    _serves_standard_and_fast(folder)


def test_an_olmoe_folder_serves_standard_and_fast(tmp_path):
    folder = save_hf_folder_atomically(
        load_policy("tiny:olmoe"), load_tokenizer("tiny:olmoe"), tmp_path / "olmoe"
    )
    _serves_standard_and_fast(folder)


def _serves_standard_and_fast(folder) -> None:
    cfg = load_config(None, ["engine.num_kv_blocks=256", "engine.max_model_len=512"])
    entries = load_entries(resolve_source(str(folder), cfg, [], name="moe"), mode="both")
    assert [e.name for e in entries] == ["moe", "moe-fast"]
    state = ServeState(ServeSettings(max_queue=8, max_running=4))
    for e in entries:
        state.add_model(e)
    srv = start_server(state)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        standard = entries[0]
        ids = encode_messages(standard.tokenizer, HI)
        params = SamplingParams(temperature=0.0, max_tokens=12)
        want = standard.engine.generate([GenerationRequest(ids, params)])[0].completions[0]
        reply = client.chat.completions.create(model="moe", messages=HI, max_tokens=12, temperature=0.0)
        assert reply.choices[0].message.content == want.text
        assert reply.usage.prompt_tokens == len(ids)
        # fast mode (serve.fast: quantized experts, speculation) serves its own engine's greedy reply
        fast_want = entries[1].engine.generate([GenerationRequest(ids, params)])[0].completions[0]
        fast = client.chat.completions.create(model="moe-fast", messages=HI, max_tokens=12, temperature=0.0)
        assert fast.choices[0].message.content == fast_want.text
    finally:
        srv.stop()
