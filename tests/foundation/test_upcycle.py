"""Sparse upcycling (models/upcycle.py, `posttrain models upcycle`): the MoE equals the dense model at
initialisation, as a saved HF folder too, routes tokens over several experts, and refuses bad input."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams
from posttrain.models import load_policy, load_tokenizer
from posttrain.models.upcycle import upcycle

runner = CliRunner()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_upcycled_logits_equal_the_dense_model_and_noise_breaks_it():
    dense = load_policy("tiny:llama")
    ids = torch.randint(3, 40000, (2, 24), generator=torch.Generator().manual_seed(0))
    moe = upcycle(dense, experts=4, top_k=2, seed=1)
    assert moe.config.model_type == "mixtral" and moe.config.num_local_experts == 4
    ref = _logits(dense, ids)
    torch.testing.assert_close(_logits(moe, ids), ref, rtol=0, atol=1e-5)
    # top 3 of 4: renormalised weights of thirds still sum to 1
    torch.testing.assert_close(_logits(upcycle(dense, 4, 3), ids), ref, rtol=0, atol=1e-5)
    noisy = upcycle(dense, 4, 2, expert_noise=0.1)
    assert (_logits(noisy, ids) - ref).abs().max() > 1e-3
    qwen = load_policy("tiny:qwen3")
    q_moe = upcycle(qwen, 4, 2)
    assert q_moe.config.model_type == "qwen3_moe" and q_moe.config.norm_topk_prob
    torch.testing.assert_close(_logits(q_moe, ids), _logits(qwen, ids), rtol=0, atol=1e-5)


def test_cli_writes_a_folder_the_engine_serves_like_the_dense_model(tmp_path):
    out = tmp_path / "moe"
    res = runner.invoke(
        app, ["models", "upcycle", "tiny:llama", "--experts", "4", "--top-k", "2", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "mixtral, 4 experts, top 2" in res.output
    moe = load_policy(str(out))
    dense = load_policy("tiny:llama")
    tok = load_tokenizer("tiny:llama")
    prompt = torch.randint(3, 40000, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    moe_engine = PagedEngine(moe, tok, num_blocks=64)
    got = moe_engine.generate([GenerationRequest(prompt, params)])[0].completions[0]
    want = (
        PagedEngine(dense, tok, num_blocks=64).generate([GenerationRequest(prompt, params)])[0].completions[0]
    )
    assert got.token_ids == want.token_ids
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-4
    routing = moe_engine.runner.step_routing()  # the last step's expert choices: 2 layers x top 2
    assert routing is not None and routing.shape[1:] == (2, 2)


def test_cli_refuses_bad_arguments_with_usage_errors(tmp_path):
    cases = [
        (["tiny:qwen2"], "dense model types"),  # qkv bias: no Mixtral/Qwen3-MoE equivalent
        (["tiny:llama", "--experts", "1"], "--experts must be >= 2"),
        (["tiny:llama", "--top-k", "5"], "--top-k must be in [1, experts=4]"),
        (["tiny:mixtral"], "dense model types"),
        (["tiny:nope"], "unknown tiny family"),
    ]
    for args, message in cases:
        res = runner.invoke(app, ["models", "upcycle", *args, "--out", str(tmp_path / "x")])
        assert res.exit_code == 2, (args, res.output)
        assert message in res.output, (args, res.output)
    assert not (tmp_path / "x").exists()
