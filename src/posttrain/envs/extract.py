"""Pulling answers, code and JSON out of free model text: final-answer extraction for math/logic,
fenced-code extraction for code tasks, and the JSON object of a structured reply. Pure string functions; they never raise on any input.

Answer extraction order (first rule that matches wins; within a rule the LAST occurrence is used):
  1. `<answer>...</answer>` tags            -> method "tags"
  2. `\\boxed{...}` (braces balanced)        -> method "boxed"
  3. "answer is X" / "answer: X"            -> method "phrase"  (X up to the end of the line/sentence)
  4. the last number in the text            -> method "last_number"
  otherwise None                            -> method "none"
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

MAX_SCAN_CHARS = 20_000  # answers live at the end; very long outputs are scanned from their tail

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_PHRASE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass
class ExtractedAnswer:
    text: str | None
    method: str  # "tags" | "boxed" | "phrase" | "last_number" | "none"


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _clean(answer: str) -> str:
    answer = answer.strip().strip("$").strip()
    if answer.endswith("."):
        answer = answer[:-1].rstrip()
    return answer


def extract_answer(text: str) -> ExtractedAnswer:
    if not isinstance(text, str) or not text.strip():
        return ExtractedAnswer(None, "none")
    text = text[-MAX_SCAN_CHARS:]
    tags = _TAG.findall(text)
    if tags:
        return ExtractedAnswer(_clean(tags[-1]), "tags")
    boxed = _last_boxed(text)
    if boxed is not None:
        return ExtractedAnswer(_clean(boxed), "boxed")
    phrases = _PHRASE.findall(text)
    if phrases:
        line = re.split(r"\.(?:\s|$)|\n", phrases[-1].strip())[0]
        if line.strip():
            return ExtractedAnswer(_clean(line), "phrase")
    numbers = _NUMBER.findall(text)
    if numbers:
        return ExtractedAnswer(numbers[-1].replace(",", ""), "last_number")
    return ExtractedAnswer(None, "none")


def normalize_number(answer: str) -> str:
    """'1,234' -> '1234', '7.0' -> '7', '+5' -> '5'; anything that is not a plain number is returned as is."""
    s = answer.strip().replace(",", "")
    if re.fullmatch(r"[+-]?\d+(?:\.\d+)?", s):
        if "." in s:
            s = s.rstrip("0").rstrip(".")
        s = s.lstrip("+")
        if s in ("-0", ""):
            s = "0"
    return s if re.fullmatch(r"-?\d+(?:\.\d+)?", s) else answer.strip()


def code_blocks(text: str, language: str = "python") -> list[str]:
    """All non-empty fenced code blocks tagged `language` (or untagged), in order."""
    if not isinstance(text, str):
        return []
    names = ("", language, "py") if language == "python" else ("", language)
    return [body for lang, body in _FENCE.findall(text[-200_000:]) if lang.lower() in names and body.strip()]


def extract_code(text: str, language: str = "python", prefer: str | None = None) -> str | None:
    """The last fenced code block tagged `language` (or untagged) - or, when `prefer` is given, the last
    one containing that regex (e.g. the requested `def name(`), falling back to the last block. None when
    there is no non-empty fenced block."""
    blocks = code_blocks(text, language)
    if prefer is not None:
        matching = [b for b in blocks if re.search(prefer, b, re.MULTILINE)]
        if matching:
            return matching[-1]
    return blocks[-1] if blocks else None


def json_object_or_error(text: str) -> tuple[dict | None, str | None]:
    """(object, None) for the JSON object in a reply - the whole text, a fenced block, or the outermost
    {...}, first that parses - else (None, the parse error of the most complete candidate)."""
    if not isinstance(text, str):
        return None, "the reply is not text"
    if "{" not in text:
        return None, "no JSON object found (expected {...})"
    candidates = [text.strip()]
    fence = re.search(r"```(?:json)?\s*\n(.*?)```", text, re.DOTALL)
    if fence:
        candidates.append(fence.group(1).strip())
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start : end + 1])
    error = "no JSON object found (expected {...})"
    for c in candidates:
        try:
            obj = json.loads(c)
        except json.JSONDecodeError as e:
            error = f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}"
            continue
        except (ValueError, RecursionError):
            error = "invalid JSON: nested too deeply or malformed"
            continue
        if isinstance(obj, dict):
            return obj, None
        error = f"the JSON is a {type(obj).__name__}, not an object"
    return None, error


def parse_json_object(text: str) -> dict | None:
    """The JSON object in a reply (`json_object_or_error`), or None."""
    return json_object_or_error(text)[0]
