from __future__ import annotations

from posttrain.envs.tools import Tool, ToolError, execute_call, fn_schema, validate_arguments
from posttrain.types import ToolCall, ToolSpec

from .conftest import run

SPEC = ToolSpec(
    "set_price",
    "Set a price.",
    fn_schema({"sku": {"type": "string"}, "price": {"type": "integer", "minimum": 1}}, ["sku", "price"]),
)


def test_schema_errors_are_named():
    assert validate_arguments(SPEC, {"sku": "A", "price": 3}) == []
    assert validate_arguments(SPEC, {"sku": "A"}) == ["'price' is a required property"]
    assert validate_arguments(SPEC, {"sku": "A", "price": 0}) == ["price: 0 is less than the minimum of 1"]
    assert validate_arguments(SPEC, {"sku": 5, "price": 2}) == ["sku: 5 is not of type 'string'"]
    assert (
        "Additional properties are not allowed"
        in validate_arguments(SPEC, {"sku": "A", "price": 2, "x": 1})[0]
    )
    assert validate_arguments(SPEC, [1]) == ["arguments must be a JSON object, got list"]


def _tools():
    def set_price(sku: str, price: int):
        if sku != "A":
            raise ToolError("not_found", f"no product '{sku}'")
        return {"sku": sku, "price": price}

    def boom(**_):
        raise ZeroDivisionError("bug")

    return {"set_price": Tool(SPEC, set_price), "boom": Tool(ToolSpec("boom", "", fn_schema({})), boom)}


def test_execute_call_outcomes():
    tools = _tools()
    ok = run(execute_call(tools, ToolCall("c1", "set_price", {"sku": "A", "price": 4})))
    assert ok.ok and ok.message.role == "tool" and ok.message.tool_call_id == "c1"
    assert ok.message.content == '{"price": 4, "sku": "A"}'
    unknown = run(execute_call(tools, ToolCall("c2", "nope", {})))
    assert unknown.invalid and "no tool named 'nope'" in unknown.message.content
    bad = run(execute_call(tools, ToolCall("c3", "set_price", {"sku": "A"})))
    assert bad.invalid and "invalid_arguments" in bad.message.content
    typed = run(execute_call(tools, ToolCall("c4", "set_price", {"sku": "B", "price": 2})))
    assert typed.tool_error and not typed.invalid and '"error": "not_found"' in typed.message.content
    internal = run(execute_call(tools, ToolCall("c5", "boom", {})))
    assert internal.internal_error and "ZeroDivisionError" in internal.message.content
