from __future__ import annotations

import pytest

from posttrain.envs.parsers import get_parser


def test_smollm2_parses_a_list_of_calls_with_ids():
    p = get_parser("smollm2")
    out = p.parse(
        'ok <tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>',
        turn=2,
    )
    assert [(c.id, c.name, c.arguments) for c in out.calls] == [
        ("call_2_0", "a", {"x": 1}),
        ("call_2_1", "b", {}),
    ]
    assert out.errors == [] and out.content == "ok"


def test_smollm2_accepts_single_object_and_string_arguments():
    p = get_parser("smollm2")
    out = p.parse('<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert [(c.name, c.arguments) for c in out.calls] == [("a", {"x": 2})]


def test_hermes_one_object_per_block_and_rejects_lists():
    p = get_parser("hermes")
    out = p.parse(
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "b", '
        '"arguments": {"y": "z"}}</tool_call>'
    )
    assert [(c.name, c.arguments) for c in out.calls] == [("a", {"x": 1}), ("b", {"y": "z"})]
    bad = p.parse('<tool_call>[{"name": "a", "arguments": {}}]</tool_call>')
    assert bad.calls == [] and "one JSON object" in bad.errors[0]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>[{"name": "a"', "unclosed"),
        ('<tool_call>[{"arguments": {}}]</tool_call>', "non-empty string 'name'"),
        ('<tool_call>[{"name": "a", "arguments": [1]}]</tool_call>', "must be a JSON object"),
        ("<tool_call>[]</tool_call>", "empty tool-call list"),
        ("done </tool_call>", "without a matching"),
    ],
)
def test_malformed_blocks_are_reported_not_guessed(text, fragment):
    out = get_parser("smollm2").parse(text)
    assert out.calls == []
    assert any(fragment in e for e in out.errors), out.errors


def test_plain_text_has_no_markup_and_non_text_is_an_error():
    p = get_parser("smollm2")
    out = p.parse("The answer is 4.")
    assert not out.has_markup and out.content == "The answer is 4."
    assert p.parse(None).errors  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["smollm2", "hermes", "qwen"])
def test_format_then_parse_round_trips(fmt):
    p = get_parser(fmt)
    calls = [("read_file", {"path": "app/x.py"}), ("submit", {})]
    text = p.format_calls(calls)
    assert [(c.name, c.arguments) for c in p.parse(text).calls] == calls


def test_unknown_format_names_the_valid_ones():
    with pytest.raises(ValueError, match="valid: hermes, qwen, qwen2, smollm2"):
        get_parser("llama3")
