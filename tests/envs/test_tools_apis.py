from __future__ import annotations

import pytest

from posttrain.envs import get_domain, run_episode
from posttrain.envs.domains.tools_apis import ShopService, replay
from posttrain.envs.tools import ToolError

from .conftest import run


def _service():
    d = get_domain("tools.apis")
    return ShopService(d.task("train", 2, 0).meta["initial_state"])


def test_service_typed_errors():
    s = _service()
    with pytest.raises(ToolError) as e:
        s.get_product("SKU-999")
    assert e.value.code == "not_found"
    sku = sorted(s.products)[0]
    with pytest.raises(ToolError) as e:
        s.update_stock(sku, -(s.products[sku]["stock"] + 1))
    assert e.value.code == "insufficient_stock"
    c = next(iter(s.customers.values()))
    with pytest.raises(ToolError) as e:
        s.create_customer("Someone", c["email"])
    assert e.value.code == "conflict"
    with pytest.raises(ToolError) as e:
        s.create_customer("Someone", "not-an-email")
    assert e.value.code == "invalid_argument"


def test_order_then_cancel_restores_stock_and_numbers_orders():
    s = _service()
    sku = max(s.products, key=lambda k: s.products[k]["stock"])
    s.products[sku]["stock"] = 10
    cid = sorted(s.customers)[0]
    before = s.state["next_order"]
    o = s.create_order(cid, sku, 3)
    assert (
        o["id"] == f"O-{before}"
        and s.products[sku]["stock"] == 7
        and o["total"] == 3 * s.products[sku]["price"]
    )
    s.cancel_order(o["id"])
    assert s.products[sku]["stock"] == 10
    with pytest.raises(ToolError, match="already cancelled"):
        s.cancel_order(o["id"])


def test_multi_turn_episode_transcript_and_counts():
    d = get_domain("tools.apis")
    task = d.task("train", 2, 0)
    ref = d.reference(task)
    res = run(run_episode(d.make_env(), task, ref))
    assert res.reward == 1.0 and res.turns == len(ref) == len(task.meta["gold_actions"]) + 1
    roles = [m.role for m in res.transcript]
    assert roles[:2] == ["system", "user"]
    assert roles[2:] == ["assistant", "tool"] * len(task.meta["gold_actions"]) + ["assistant"]
    assert res.info["tool_calls"] == len(task.meta["gold_actions"]) and res.info["invalid_tool_calls"] == 0


def test_bad_arguments_are_observations_the_model_can_recover_from():
    d = get_domain("tools.apis")
    task = d.task("train", 0, 0)
    ref = d.reference(task)
    bad = '<tool_call>[{"name": "set_price", "arguments": {"sku": 104, "price": "cheap"}}]</tool_call>'
    res = run(run_episode(d.make_env(), task, [bad, *ref]))
    tool_msg = res.transcript[3]
    assert tool_msg.role == "tool" and "invalid_arguments" in tool_msg.content
    assert res.info["invalid_tool_calls"] == 1
    # state is right and the model finished, but the invalid call halves the format component
    assert res.rewards == {"state": 1.0, "correct": 1.0, "format": 0.5, "finished": 1.0, "success": 1.0}
    assert res.reward == pytest.approx(0.85 + 0.15 * 0.5)


def test_format_credit_is_graded():
    d = get_domain("tools.apis")
    task = d.task("train", 0, 0)
    assert "Use " in task.prompt[-1].content and "<tool_call>" in task.prompt[-1].content
    cases = {
        "I would rather not.": 0.0,
        "<tool_call>set_price SKU</tool_call> then done": 0.25,
        '<tool_call>[{"name": "nope", "arguments": {}}]</tool_call>': 0.5,
    }
    for text, fmt in cases.items():
        res = run(run_episode(d.make_env(), task, [text, "ok"]))
        assert res.rewards["format"] == fmt and res.rewards["correct"] == 0.0, text
        assert res.reward == pytest.approx(0.15 * fmt)


def test_truncated_episode_gets_half_correctness_credit():
    d = get_domain("tools.apis", max_turns=1)
    task = d.task("train", 0, 3)
    res = run(run_episode(d.make_env(), task, d.reference(task)))
    assert res.info["truncated"] is True
    assert res.reward == pytest.approx(0.85 * 0.5 + 0.15)


def test_finalize_scores_the_state_as_it_stands():
    d = get_domain("tools.apis")
    task = d.task("train", 0, 3)

    async def go():
        env = d.make_env()
        await env.reset(task)
        await env.step(d.reference(task)[0])
        return await env.finalize()

    res = run(go())
    assert res.done and res.info["truncated"] and res.rewards["state"] == 1.0


def test_wrong_answer_fails_even_with_the_right_state():
    d = get_domain("tools.apis")
    task = next(t for t in (d.task("train", 1, i) for i in range(30)) if t.meta["answer"] is not None)
    ref = d.reference(task)
    res = run(run_episode(d.make_env(), task, [*ref[:-1], "<answer>definitely wrong</answer>"]))
    assert res.rewards["state"] == 1.0 and res.rewards["answer"] == 0.0 and res.reward == pytest.approx(0.15)


def test_hermes_chat_format_end_to_end():
    d = get_domain("tools.apis")
    task = d.task("heldout", 3, 1)
    ref = d.reference(task, chat_format="hermes")
    assert ref[0].startswith("<tool_call>\n{")
    assert run(run_episode(d.make_env(None, chat_format="hermes"), task, ref)).reward == 1.0


def test_gold_replay_is_what_the_verifier_compares_to():
    d = get_domain("tools.apis")
    task = d.task("train", 0, 5)
    gold, _ = replay(task.meta["initial_state"], task.meta["gold_actions"])
    assert gold != task.meta["initial_state"]  # level-0 requests all change the state
