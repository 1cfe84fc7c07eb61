"""Decode staging: rows hold exactly the pool's K/V across joins, leaves, growth and stale keys; the engine
with staging gives the same outputs as HF and as the gather path while membership changes."""

from __future__ import annotations

import pytest
import torch

from engine.helpers import hf_greedy, random_prompts, tiny
from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams
from posttrain.engine.decode_stage import DecodeStager

LAYERS, KV, HD, BS, BLOCKS = 2, 3, 4, 4, 32


def _pool(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, BLOCKS, BS, KV, HD)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _tokens(pool: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
    """The first n tokens of a sequence as `[layers, kv, n, hd]`, read block by block."""
    rows = [pool[:, table[p // BS], p % BS] for p in range(n)]  # each [layers, kv, hd]
    return torch.stack(rows, dim=2)


def _stager(**kw) -> DecodeStager:
    return DecodeStager(
        (LAYERS, KV, HD), torch.float32, torch.device("cpu"), block_size=BS, max_rows=8, max_len=64, **kw
    )


def _check_rows(stager: DecodeStager, pool_k, pool_v, tables: dict, lengths: dict) -> None:
    seen = set()
    for stage in stager.stages:
        for r, key in enumerate(stage.keys):
            n = lengths[key]
            assert stage.lengths[r] == n
            assert torch.equal(stage.k[:, r, :, :n], _tokens(pool_k, tables[key], n))
            assert torch.equal(stage.v[:, r, :, :n], _tokens(pool_v, tables[key], n))
            seen.add(key)
    assert seen == set(lengths)


def _step(stager, pool_k, pool_v, members, tables, lengths):
    """What one engine step does: plan, then write one new token per row to the pool and the stage."""
    groups = stager.plan([(key, lengths[key], tables[key]) for key in members], pool_k, pool_v)
    for grp in groups:
        D = len(grp.members)
        new_k, new_v = torch.randn(LAYERS, D, KV, HD), torch.randn(LAYERS, D, KV, HD)
        for r, i in enumerate(grp.members):
            key = members[i]
            pos = lengths[key]
            assert int(grp.positions[r]) == pos
            pool_k[:, tables[key][pos // BS], pos % BS] = new_k[:, r]
            pool_v[:, tables[key][pos // BS], pos % BS] = new_v[:, r]
            lengths[key] = pos + 1
        for layer in range(LAYERS):  # as the runner writes the step's tokens into the stage
            grp.stage.k[layer].view(-1, HD).index_copy_(0, grp.write_index, new_k[layer].reshape(-1, HD))
            grp.stage.v[layer].view(-1, HD).index_copy_(0, grp.write_index, new_v[layer].reshape(-1, HD))
        assert grp.width == max(lengths[members[i]] for i in grp.members)
    return groups


def test_stage_rows_match_the_pool_through_joins_leaves_growth_and_stale_keys():
    pool_k, pool_v = _pool(0)
    tables = {"a": [3, 7, 1, 9, 12, 13], "b": [4, 5, 6, 14, 15, 16], "c": [2, 8, 17, 18, 19, 20]}
    lengths = {"a": 5, "b": 6, "c": 2}
    stager = _stager()
    for _ in range(3):
        _step(stager, pool_k, pool_v, ["a", "b", "c"], tables, lengths)
    assert stager.rows_filled == 3  # each joined once; later steps only append
    _check_rows(stager, pool_k, pool_v, tables, lengths)
    # "a" leaves (finished): the last row moves into its place, nobody is re-read from the pool
    del lengths["a"]
    _step(stager, pool_k, pool_v, ["b", "c"], tables, lengths)
    assert stager.rows_filled == 3
    _check_rows(stager, pool_k, pool_v, tables, lengths)
    # "b" was preempted and recomputed: a new key (and a different length) means a fresh fill
    tables["b2"], lengths["b2"] = tables.pop("b"), lengths.pop("b") - 2
    for _ in range(12):  # past the initial capacity: rows grow and keep their contents
        _step(stager, pool_k, pool_v, ["c", "b2"], tables, lengths)
    assert stager.rows_filled == 4
    _check_rows(stager, pool_k, pool_v, tables, lengths)
    # a member whose length disagrees with its row (K/V recomputed elsewhere) is re-read, not trusted
    lengths["c"] -= 1
    _step(stager, pool_k, pool_v, ["c", "b2"], tables, lengths)
    assert stager.rows_filled == 5
    _check_rows(stager, pool_k, pool_v, tables, lengths)
    _step(stager, pool_k, pool_v, [], tables, {})
    assert stager.stages == [] and stager.nbytes() == 0


def test_stages_group_similar_lengths_and_mask_the_padding():
    pool_k, pool_v = _pool(1)
    tables = {k: list(range(i * 5, i * 5 + 5)) for i, k in enumerate("abcd")}
    lengths = {"a": 2, "b": 3, "c": 15, "d": 16}
    groups = _step(_stager(slack=1.25), pool_k, pool_v, list("abcd"), tables, lengths)
    # longest first: {d, c} share a stage (2 x 16 <= 1.25 x 31); a or b with them would pad 4 x 16 rows
    assert sorted(sorted("abcd"[i] for i in g.members) for g in groups) == [["a", "b"], ["c", "d"]]
    for g in groups:
        lens = [int(p) + 1 for p in g.positions]
        if min(lens) == max(lens):
            assert g.mask is None
        else:
            attended = (g.mask[:, 0, 0, :] == 0).sum(-1).tolist()
            assert attended == lens and g.mask.shape[-1] == max(lens)


def test_a_stage_shrinks_when_its_rows_leave_and_keeps_their_contents():
    pool_k, pool_v = _pool(2)
    keys = [f"s{i}" for i in range(6)]
    tables = {k: list(range(i * 5, i * 5 + 5)) for i, k in enumerate(keys)}
    lengths = {k: 14 for k in keys}
    stager = _stager(max_groups=1)
    _step(stager, pool_k, pool_v, keys, tables, lengths)
    (stage,) = stager.stages
    cell = 2 * LAYERS * KV * HD * 4  # K and V bytes of one token slot
    # fresh: 6 rows + a quarter = 8 (max_rows), 15 tokens + 2 blocks of headroom, rounded up to a block = 24
    assert (stage.rows_capacity, stage.len_capacity) == (8, 24) and stager.nbytes() == 8 * 24 * cell
    for k in keys[1:]:  # five of six leave: 8 x 24 slots for 1 x 16 is past SHRINK_AT x a fresh 2 x 24
        del lengths[k]
    _step(stager, pool_k, pool_v, ["s0"], tables, lengths)
    (stage,) = stager.stages
    assert (stage.rows_capacity, stage.len_capacity) == (2, 24) and stager.nbytes() == 2 * 24 * cell
    assert stager.rows_filled == 6  # the survivor was copied within the stage, not read again from the pool
    _check_rows(stager, pool_k, pool_v, tables, lengths)
    # a shrink only when the gap is wide: one row of two leaving keeps the allocation
    lengths["s1"] = 3
    _step(stager, pool_k, pool_v, ["s0", "s1"], tables, lengths)
    before = [(s.rows_capacity, s.len_capacity) for s in stager.stages]
    del lengths["s1"]
    _step(stager, pool_k, pool_v, ["s0"], tables, lengths)
    assert [(s.rows_capacity, s.len_capacity) for s in stager.stages] == before[:1]
    _check_rows(stager, pool_k, pool_v, tables, lengths)


def test_past_max_bytes_a_sequence_is_left_to_the_gather_path_and_joins_once_room_frees():
    pool_k, pool_v = _pool(3)
    tables = {k: list(range(i * 5, i * 5 + 5)) for i, k in enumerate("abc")}
    lengths = {"a": 10, "b": 10, "c": 10}
    cell = 2 * LAYERS * KV * HD * 4
    # fresh allocations for rows of 11 tokens (10 + the step's): 11 + 2 blocks -> 20 slots; 2 rows -> 3 rows
    # of capacity (a quarter more, rounded up), 3 -> 4. So a and b fit in 3 x 20 slots, and c would need 4 x 20.
    stager = _stager(max_groups=1, max_bytes=3 * 20 * cell)
    groups = _step(stager, pool_k, pool_v, list("abc"), tables, lengths)
    staged = sorted("abc"[i] for g in groups for i in g.members)
    assert staged == ["a", "b"] and stager.nbytes() == 3 * 20 * cell
    lengths["c"] += 1  # the engine decoded c from the pool this step
    _check_rows(stager, pool_k, pool_v, tables, {k: lengths[k] for k in staged})
    del lengths["a"]  # a finishes: c takes its place
    groups = _step(stager, pool_k, pool_v, ["b", "c"], tables, lengths)
    assert sorted("bc"[i] for g in groups for i in g.members) == ["b", "c"]
    assert stager.nbytes() == 3 * 20 * cell  # c took a's row: no reallocation
    _check_rows(stager, pool_k, pool_v, tables, lengths)
    # nothing fits: every member is left out and no empty stage stays behind
    tiny_stager = _stager(max_bytes=cell)
    assert tiny_stager.plan([("x", 10, tables["a"])], pool_k, pool_v) == []
    assert tiny_stager.stages == [] and tiny_stager.nbytes() == 0


def _greedy_requests(seed: int) -> list[GenerationRequest]:
    prompts = random_prompts([1, 3, 6, 13, 17, 30, 2, 9], seed=seed)
    return [
        GenerationRequest(p, SamplingParams(temperature=0.0, max_tokens=4 + 3 * (i % 4), ignore_eos=True))
        for i, p in enumerate(prompts)
    ]


def test_engine_with_staging_matches_hf_and_the_gather_path_as_membership_changes(tokenizer):
    model = tiny("llama")
    # different lengths, fewer running at once than asked: sequences leave and join the stages every few steps
    reqs = _greedy_requests(seed=40)
    outs = {}
    for staging in (True, False):
        engine = PagedEngine(
            model, tokenizer, block_size=4, num_blocks=64, max_num_seqs=3, decode_staging=staging
        )
        outs[staging] = engine.generate(reqs)
        if staging:
            assert engine.stager.rows_filled == len(reqs)
            assert engine.stager.stages == [] and engine.kv_stats()["decode_stage_bytes"] == 0
    for req, staged, gathered in zip(reqs, outs[True], outs[False], strict=True):
        a, b = staged.completions[0], gathered.completions[0]
        assert a.token_ids == b.token_ids == hf_greedy(model, req.prompt_token_ids, req.params.max_tokens)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


def test_engine_past_its_staging_budget_mixes_staged_and_gathered_rows_and_matches_hf(tokenizer):
    model = tiny("llama")
    reqs = _greedy_requests(seed=41)
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=64, max_num_seqs=4)
    spec = engine.runner.spec
    pool_slots = 64 * 4
    assert engine.stager.max_bytes == 2 * pool_slots * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    engine.stager.max_bytes = 2 * 24 * 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # 48 slots
    seen = []
    plan = engine.stager.plan

    def counting(members, *args):
        groups = plan(members, *args)
        seen.append((len(members), sum(len(g.members) for g in groups)))
        assert engine.stager.nbytes() <= engine.stager.max_bytes
        return groups

    engine.stager.plan = counting
    outs = engine.generate(reqs)
    assert any(0 < staged < n for n, staged in seen)  # some steps decoded staged and gathered rows together
    for req, out in zip(reqs, outs, strict=True):
        assert out.completions[0].token_ids == hf_greedy(model, req.prompt_token_ids, req.params.max_tokens)


def test_prepacked_gemms_agree_with_plain_linear_and_follow_weight_reloads(tokenizer):
    old, new = tiny("llama", 0), tiny("llama", 1)
    engine = PagedEngine(old, tokenizer, block_size=4, num_blocks=64)
    runner = engine.runner
    if not runner.use_packed:
        pytest.skip("oneDNN weight packing is not available on this machine")
    x = torch.randn(5, runner.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    for state in (old.state_dict(), new.state_dict()):
        engine.load_weights(state)
        for li, layer in enumerate(runner.layers):
            got = runner._linear(x, layer["wgu"], runner.packed[li]["wgu"])
            assert torch.allclose(got, torch.nn.functional.linear(x, layer["wgu"]), rtol=1e-5, atol=1e-5)
        logits = runner._linear(x, runner.lm_head, runner.packed_lm_head)
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        assert torch.allclose(logits, x @ head.t(), rtol=1e-5, atol=1e-5)
