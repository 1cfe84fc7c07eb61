"""The repository tools and prompt shared by every "fix the failing build" episode: the `swe.ci_fix`
training domain and the CI auto-fix agent (`posttrain.apps.ci_fix`) expose the same tool specs over the
same in-memory working copy (`RepoFiles`: read_file, search, list_dir, apply_patch, write_file), and
build the same first prompt (failure log trimmed around the traceback, the files it names, a map of the
repository). Also owns unified diffs: writing them (`unified_diff`) and applying them (`apply_patch`).

Pure functions over `{path: text}`; running tests (`run_tests`) and scoring belong to each user.
"""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posttrain.envs.tools import Tool, ToolError, fn_schema
from posttrain.types import Message, ToolSpec

MAX_FILE_CHARS = 50_000
MAX_FILES = 2000
MAX_SEARCH_HITS = 50
MAX_PATCH_CHARS = 100_000
PATH_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)*$")

SYSTEM = (
    "You are fixing a failing build in a Python repository. Use the tools to read and search files, "
    "change the code (apply_patch takes a unified diff; write_file replaces a whole file), run the "
    "tests, and call submit when they pass. Do not modify the tests."
)

TOOL_SPECS = {
    s.name: s
    for s in [
        ToolSpec(
            "read_file",
            "Read a file of the repository.",
            fn_schema({"path": {"type": "string", "maxLength": 200}}, ["path"]),
        ),
        ToolSpec(
            "search",
            "Search the repository's text files for a regular expression; returns path:line: text.",
            fn_schema(
                {
                    "pattern": {"type": "string", "minLength": 1, "maxLength": 200},
                    "path": {"type": "string", "maxLength": 200},
                },
                ["pattern"],
            ),
        ),
        ToolSpec(
            "list_dir",
            "List the files and folders directly under a folder of the repository ('' = the root).",
            fn_schema({"path": {"type": "string", "maxLength": 200}}),
        ),
        ToolSpec(
            "apply_patch",
            "Apply a unified diff (--- a/path, +++ b/path, @@ hunks) to the repository.",
            fn_schema({"patch": {"type": "string", "minLength": 1, "maxLength": MAX_PATCH_CHARS}}, ["patch"]),
        ),
        ToolSpec(
            "write_file",
            "Replace (or create) a file with the given full content.",
            fn_schema(
                {
                    "path": {"type": "string", "maxLength": 200},
                    "content": {"type": "string", "maxLength": MAX_FILE_CHARS},
                },
                ["path", "content"],
            ),
        ),
        ToolSpec(
            "run_tests",
            "Run the tests and report failures; `tests` optionally selects test files or ids.",
            fn_schema(
                {"tests": {"type": "array", "items": {"type": "string", "maxLength": 300}, "maxItems": 20}}
            ),
        ),
        ToolSpec("submit", "Finish: submit the repository as it is now.", fn_schema({})),
    ]
}


def check_path(path: str) -> None:
    if not PATH_RE.match(path) or ".." in path.split("/"):
        raise ToolError("invalid_argument", f"'{path}' is not a relative path inside the repository")


# ---- unified diffs ---------------------------------------------------------------------------------


class PatchError(ValueError):
    """A patch that is malformed or does not apply; the message says which file and hunk, and why."""


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def unified_diff(before: dict[str, str], after: dict[str, str]) -> str:
    """A git-style unified diff from `before` to `after` (files added, changed or removed), which both
    `apply_patch` and `git apply` accept."""
    out: list[str] = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        a = f"a/{path}" if old is not None else "/dev/null"
        b = f"b/{path}" if new is not None else "/dev/null"
        out.append(f"diff --git a/{path} b/{path}\n")
        if old is None:
            out.append("new file mode 100644\n")
        elif new is None:
            out.append("deleted file mode 100644\n")
        for line in difflib.unified_diff(_lines(old or ""), _lines(new or ""), a, b, n=3):
            if line.startswith(("---", "+++")):
                line = line.rstrip(" \t\n") + "\n"  # difflib appends a tab when the date is empty
            out.append(line)
            if not line.endswith("\n"):
                out.append("\n\\ No newline at end of file\n")
    return "".join(out)


@dataclass
class _Hunk:
    old_start: int
    old: list[str]
    new: list[str]
    header: str


@dataclass
class _FilePatch:
    old_path: str | None
    new_path: str | None
    hunks: list[_Hunk]


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip_prefix(name: str) -> str | None:
    name = name.split("\t", 1)[0].strip()
    if name == "/dev/null":
        return None
    return name[2:] if name.startswith(("a/", "b/")) else name


def parse_patch(patch: str) -> list[_FilePatch]:
    lines = patch.splitlines(keepends=True)
    files: list[_FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"line {i + 1}: '---' header without a '+++' line after it")
        fp = _FilePatch(_strip_prefix(line[4:]), _strip_prefix(lines[i + 1][4:]), [])
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK.match(lines[i])
            if not m:
                raise PatchError(f"line {i + 1}: malformed hunk header {lines[i].strip()!r}")
            old_n = int(m.group(2)) if m.group(2) is not None else 1
            new_n = int(m.group(4)) if m.group(4) is not None else 1
            hunk = _Hunk(int(m.group(1)), [], [], lines[i].strip())
            i += 1
            while i < len(lines) and (len(hunk.old) < old_n or len(hunk.new) < new_n):
                body = lines[i]
                tag, text = body[:1], body[1:]
                if body.startswith("\\"):  # "\ No newline at end of file"
                    _drop_newline(hunk, lines[i - 1])
                    i += 1
                    continue
                if tag == "\n" or body == "\n":  # an empty context line whose leading space was stripped
                    tag, text = " ", "\n"
                if tag not in " -+":
                    raise PatchError(
                        f"line {i + 1}: hunk {hunk.header} ends early: expected {old_n} old and {new_n} "
                        f"new lines, got {len(hunk.old)} and {len(hunk.new)}"
                    )
                if tag in " -":
                    hunk.old.append(text)
                if tag in " +":
                    hunk.new.append(text)
                i += 1
            if len(hunk.old) != old_n or len(hunk.new) != new_n:
                raise PatchError(f"hunk {hunk.header} is truncated (the patch ended inside it)")
            while i < len(lines) and lines[i].startswith("\\"):  # "\ No newline at end of file"
                _drop_newline(hunk, lines[i - 1])
                i += 1
            fp.hunks.append(hunk)
        if not fp.hunks:
            raise PatchError(f"no @@ hunk after the headers of {fp.new_path or fp.old_path}")
        files.append(fp)
    if not files:
        raise PatchError("not a unified diff: no '--- a/path' / '+++ b/path' headers found")
    return files


def _drop_newline(hunk: _Hunk, previous: str) -> None:
    tag = previous[:1]
    for side, tags in ((hunk.old, " -"), (hunk.new, " +")):
        if tag in tags and side and side[-1].endswith("\n"):
            side[-1] = side[-1][:-1]


def _apply_hunks(path: str, text: str, hunks: list[_Hunk]) -> str:
    lines = _lines(text)
    out: list[str] = []
    pos = 0
    for k, hunk in enumerate(hunks, 1):
        want = max(hunk.old_start - 1, 0) if hunk.old else hunk.old_start
        at = _find(lines, hunk.old, want, pos)
        if at is None:
            shown = "".join(hunk.old[:4]).rstrip("\n")
            near = "".join(lines[max(want, 0) : want + 4]).rstrip("\n")
            raise PatchError(
                f"hunk {k} ({hunk.header}) of {path} does not apply: its context/removed lines\n{shown}\n"
                f"are not in the file (around line {want + 1} it has:\n{near})"
            )
        out += lines[pos:at] + hunk.new
        pos = at + len(hunk.old)
    return "".join(out + lines[pos:])


def _find(lines: list[str], old: list[str], want: int, lo: int) -> int | None:
    """Where `old` occurs at or after `lo`, nearest to `want` (an offset like patch(1) allows)."""
    n = len(old)
    candidates = [i for i in range(lo, len(lines) - n + 1) if lines[i : i + n] == old]
    return min(candidates, key=lambda i: abs(i - want)) if candidates else None


def apply_patch(files: dict[str, str], patch: str) -> dict[str, str]:
    """`files` with the unified diff applied (a new dict); PatchError when any hunk does not apply,
    in which case nothing is changed."""
    out = dict(files)
    for fp in parse_patch(patch):
        if fp.old_path is None:
            path = fp.new_path or ""
            if path in out:
                raise PatchError(f"the patch creates {path}, which already exists")
            out[path] = _apply_hunks(path, "", fp.hunks)
            continue
        path = fp.old_path
        if path not in out:
            raise PatchError(f"the patch changes {path}, which is not in the repository")
        new_text = _apply_hunks(path, out[path], fp.hunks)
        if fp.new_path is None:
            del out[path]
        else:
            del out[path]
            out[fp.new_path] = new_text
    return out


def patched_paths(patch: str) -> list[str]:
    """Every path a patch touches (old and new names)."""
    return sorted({p for fp in parse_patch(patch) for p in (fp.old_path, fp.new_path) if p})


# ---- the working copy ------------------------------------------------------------------------------


class RepoFiles:
    """The text files of a repository as one episode sees them, behind the file tools.

    `refuse(path)` returns why a path may not be written (None when it may); refused writes and patches
    are a `ToolError("protected", ...)` and change nothing."""

    def __init__(
        self, files: dict[str, str], refuse: Callable[[str], str | None], max_files: int = MAX_FILES
    ) -> None:
        self.files = dict(files)
        self.refuse = refuse
        self.max_files = max_files

    def read_file(self, path: str) -> str:
        if path not in self.files:
            raise ToolError("not_found", f"no file '{path}' (files: {', '.join(sorted(self.files)[:60])})")
        return self.files[path]

    def list_dir(self, path: str = "") -> str:
        prefix = path.strip("/")
        if prefix:
            check_path(prefix)
            prefix += "/"
        entries = set()
        for p in self.files:
            if p.startswith(prefix):
                head, sep, _ = p[len(prefix) :].partition("/")
                entries.add(head + "/" if sep else head)
        if not entries:
            raise ToolError("not_found", f"no folder '{path}' in the repository")
        return "\n".join(sorted(entries))

    def search(self, pattern: str, path: str = "") -> str:
        try:
            rx = re.compile(pattern)
        except re.error as err:
            raise ToolError(
                "invalid_argument", f"'{pattern}' is not a valid regular expression: {err}"
            ) from None
        prefix = path.strip("/")
        hits = []
        for p in sorted(self.files):
            if prefix and not (p == prefix or p.startswith(prefix + "/")):
                continue
            for n, line in enumerate(self.files[p].splitlines(), 1):
                if rx.search(line):
                    hits.append(f"{p}:{n}: {line.strip()[:200]}")
                    if len(hits) >= MAX_SEARCH_HITS:
                        return "\n".join(hits) + f"\n... (stopped at {MAX_SEARCH_HITS} matches)"
        return "\n".join(hits) if hits else f"no match for '{pattern}'"

    def _check_write(self, path: str) -> None:
        check_path(path)
        why = self.refuse(path)
        if why:
            raise ToolError("protected", why)

    def write_file(self, path: str, content: str) -> str:
        self._check_write(path)
        if path not in self.files and len(self.files) >= self.max_files:
            raise ToolError("invalid_argument", f"too many files (limit {self.max_files})")
        self.files[path] = content
        return f"wrote {len(content)} characters to {path}"

    def apply_patch(self, patch: str) -> str:
        try:
            paths = patched_paths(patch)
            for p in paths:
                self._check_write(p)
            patched = apply_patch(self.files, patch)
            if len(patched) > max(len(self.files), self.max_files):
                raise ToolError("invalid_argument", f"too many files (limit {self.max_files})")
            self.files = patched
        except PatchError as err:
            raise ToolError("patch_does_not_apply", str(err)) from None
        return f"patched {', '.join(paths)}"


def repo_tools(repo: RepoFiles, run_tests: Callable[..., Any], submit: Callable[[], str]) -> dict[str, Tool]:
    """The seven tools of a fixing episode: the file tools over `repo`, and the user's `run_tests`
    (optional `tests` selection) and `submit`."""
    fns = {
        "read_file": repo.read_file,
        "search": repo.search,
        "list_dir": repo.list_dir,
        "apply_patch": repo.apply_patch,
        "write_file": repo.write_file,
        "run_tests": run_tests,
        "submit": submit,
    }
    return {name: Tool(TOOL_SPECS[name], fn) for name, fn in fns.items()}


# ---- the first prompt ------------------------------------------------------------------------------

_TRACE_FILE = re.compile(r'File "([^"]+\.py)", line \d+|^([\w./\-]+\.py):\d+|([\w./\-]+\.py)::', re.MULTILINE)
_LOG_MARKERS = ("Traceback", "= FAILURES =", "= ERRORS =", "FAILED", "Error", "assert")


def trim_log(log: str, max_chars: int = 4000) -> str:
    """The log, or when longer than `max_chars`: its first lines, the part from the first traceback or
    failure marker, and its last lines."""
    if len(log) <= max_chars:
        return log
    lines = log.splitlines()
    start = next((i for i, ln in enumerate(lines) if any(m in ln for m in _LOG_MARKERS)), 0)
    head = "\n".join(lines[:5])
    tail = "\n".join(lines[-25:])
    room = max(max_chars - len(head) - len(tail) - 60, 200)
    middle = "\n".join(lines[start : len(lines) - 25])[:room]
    return f"{head}\n... (log trimmed)\n{middle}\n... (log trimmed)\n{tail}"


def named_files(log: str, files: dict[str, str]) -> list[str]:
    """Repository files a log's tracebacks and failure lines name, in order of first mention (paths in
    the log may be absolute: they match a repository file by suffix)."""
    out: list[str] = []
    for m in _TRACE_FILE.finditer(log):
        name = next(g for g in m.groups() if g)
        hit = name if name in files else next((p for p in sorted(files) if name.endswith("/" + p)), None)
        if hit and hit not in out:
            out.append(hit)
    return out


def imported_files(files: dict[str, str], path: str) -> list[str]:
    """Repository modules that `path` imports by absolute name (`from app.x import y` -> app/x.py)."""
    try:
        tree = ast.parse(files[path])
    except (SyntaxError, ValueError):
        return []
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    out = []
    for name in names:
        base = name.replace(".", "/")
        for cand in (f"{base}.py", f"{base}/__init__.py", f"src/{base}.py", f"src/{base}/__init__.py"):
            if cand in files and cand not in out and cand != path:
                out.append(cand)
                break
    return out


def repo_map(files: dict[str, str], max_chars: int = 3000) -> str:
    """One line per file: Python modules with their top-level definitions and imports."""
    lines = []
    for path in sorted(files):
        if not path.endswith(".py"):
            lines.append(path)
            continue
        try:
            tree = ast.parse(files[path])
        except (SyntaxError, ValueError):
            lines.append(f"{path}: (does not parse)")
            continue
        defs, imports = [], []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                defs.append(f"{node.name}({', '.join(a.arg for a in node.args.args)})")
            elif isinstance(node, ast.ClassDef):
                defs.append(f"class {node.name}")
            elif isinstance(node, ast.Import):
                imports += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                imports.append("." * node.level + (node.module or ""))
        parts = [path]
        if defs:
            parts.append("defines " + ", ".join(defs))
        if imports:
            parts.append("imports " + ", ".join(dict.fromkeys(imports)))
        lines.append(": ".join(parts[:1]) + (": " + "; ".join(parts[1:]) if parts[1:] else ""))
    text = "\n".join(lines)
    return text if len(text) <= max_chars else text[:max_chars] + "\n... (map truncated)"


def fix_prompt(log: str, files: dict[str, str], max_file_chars: int = 6000) -> list[Message]:
    """The first messages of a fixing episode: the shared system prompt, then the repository map, the
    trimmed failure log, and the files it names with the repository modules those import (up to
    `max_file_chars` of them in all)."""
    shown, room = [], max_file_chars
    named = named_files(log, files)
    named += [p for n in list(named) for p in imported_files(files, n) if p not in named]
    for path in dict.fromkeys(named):
        text = files[path]
        if len(text) > room:
            continue
        shown.append(f"--- {path} ---\n{text}")
        room -= len(text)
    user = f"The CI build is failing.\n\nRepository map:\n{repo_map(files)}\n\nTest log:\n{trim_log(log)}\n"
    if shown:
        user += "\nFiles named by the failure:\n" + "\n".join(shown) + "\n"
    user += "\nFind and fix the bug in the code (not in the tests), then call submit."
    return [Message("system", SYSTEM), Message("user", user)]
