"""The shared repository tools: unified diffs written and applied (equal to the target, accepted by
`git apply`, random edits round-trip), patch errors that name the hunk, the file tools' errors, and
the first prompt's pieces (named files, trimmed log, repository map)."""

from __future__ import annotations

import random
import subprocess

import pytest

from posttrain.envs.repo_tools import (
    PatchError,
    RepoFiles,
    apply_patch,
    fix_prompt,
    named_files,
    repo_map,
    trim_log,
    unified_diff,
)
from posttrain.envs.tools import ToolError

BEFORE = {"a.py": "x = 1\ny = 2\nz = 3\n", "b.txt": "no newline", "gone.py": "bye\n"}
AFTER = {"a.py": "x = 1\ny = 20\nz = 3\nw = 4\n", "b.txt": "still no newline", "new/c.py": "c = 1\n"}


def test_diff_applies_back_to_the_target_and_git_accepts_it(tmp_path):
    patch = unified_diff(BEFORE, AFTER)
    assert apply_patch(BEFORE, patch) == AFTER
    assert "--- a/gone.py\n+++ /dev/null\n" in patch and "--- /dev/null\n+++ b/new/c.py\n" in patch
    assert patch.count("\\ No newline at end of file\n") == 2
    for path, text in BEFORE.items():
        (tmp_path / path).write_text(text)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "p.diff").write_text(patch)
    subprocess.run(["git", "apply", "p.diff"], cwd=tmp_path, check=True)
    assert {p: (tmp_path / p).read_text() for p in AFTER} == AFTER and not (tmp_path / "gone.py").exists()
    assert unified_diff(BEFORE, BEFORE) == ""


def test_random_edits_round_trip():
    rng = random.Random(0)
    for _ in range(300):
        a = [f"l{rng.randint(0, 5)}\n" for _ in range(rng.randint(1, 15))]
        b = list(a)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.4 and b:
                b[rng.randrange(len(b))] = f"m{rng.randint(0, 9)}\n"
            elif op < 0.7:
                b.insert(rng.randint(0, len(b)), f"n{rng.randint(0, 9)}\n")
            elif b:
                del b[rng.randrange(len(b))]
        new = "".join(b).rstrip("\n") if rng.random() < 0.3 else "".join(b)
        if new == "".join(a):
            continue
        assert apply_patch({"f": "".join(a)}, unified_diff({"f": "".join(a)}, {"f": new})) == {"f": new}


def test_a_hunk_found_at_an_offset_applies_and_a_wrong_one_names_itself():
    shifted = {"a.py": "# header\n# more\n" + BEFORE["a.py"]}
    patch = unified_diff({"a.py": BEFORE["a.py"]}, {"a.py": AFTER["a.py"]})
    assert apply_patch(shifted, patch)["a.py"] == "# header\n# more\n" + AFTER["a.py"]
    with pytest.raises(PatchError, match=r"^hunk 1 \(@@ -1,3 \+1,4 @@\) of a.py does not apply"):
        apply_patch({"a.py": "x = 1\ny = 3\nz = 3\n"}, patch)
    with pytest.raises(PatchError, match="which is not in the repository"):
        apply_patch({}, patch)
    with pytest.raises(PatchError, match="the patch ended inside it"):
        apply_patch(BEFORE, "--- a/a.py\n+++ b/a.py\n@@ -1,3 +1,3 @@\n x = 1\n")
    with pytest.raises(PatchError, match="^not a unified diff"):
        apply_patch(BEFORE, "change y to 20")


def test_file_tools():
    repo = RepoFiles(
        {"pkg/m.py": "def f():\n    return 1\n", "pkg/sub/n.py": "", "README": "hi\n"}, lambda p: None
    )
    assert repo.list_dir("") == "README\npkg/" and repo.list_dir("pkg") == "m.py\nsub/"
    assert repo.search(r"return \d") == "pkg/m.py:2: return 1"
    assert repo.search("nothing") == "no match for 'nothing'"
    for call, code in [
        (lambda: repo.read_file("../etc/passwd"), "not_found"),
        (lambda: repo.list_dir("nope"), "not_found"),
        (lambda: repo.search("("), "invalid_argument"),
        (lambda: repo.write_file("/tmp/x", ""), "invalid_argument"),
        (lambda: repo.write_file("a/../../x", ""), "invalid_argument"),
    ]:
        with pytest.raises(ToolError) as err:
            call()
        assert err.value.code == code
    guarded = RepoFiles({"t/test_x.py": "a\n"}, lambda p: "no tests" if p.startswith("t/") else None)
    with pytest.raises(ToolError, match="no tests"):
        guarded.apply_patch(unified_diff(guarded.files, {"t/test_x.py": "b\n"}))
    assert guarded.files == {"t/test_x.py": "a\n"}


def test_prompt_pieces():
    files = {
        "app/core.py": "from app.util import g\n\n\ndef f(x):\n    return g(x)\n",
        "app/util.py": "def g(y):\n    return y\n",
        "tests/test_core.py": "from app.core import f\n",
    }
    log = 'FAILED tests/test_core.py::test_f\n  File "/job/repo/app/core.py", line 5, in f\napp/util.py:2: AssertionError'
    assert named_files(log, files) == ["tests/test_core.py", "app/core.py", "app/util.py"]
    assert repo_map(files).splitlines()[0] == "app/core.py: defines f(x); imports app.util"
    long_log = "\n".join(f"noise {i}" for i in range(2000)) + "\nTraceback (most recent call last):\n  boom\n"
    trimmed = trim_log(long_log, 2000)
    assert len(trimmed) < 2300 and trimmed.startswith("noise 0") and "Traceback" in trimmed
    system, user = fix_prompt("FAILED tests/test_core.py::test_f", files)
    # the named test file and the module it imports are shown in full
    assert (
        "--- tests/test_core.py ---" in user.content and "--- app/core.py ---\nfrom app.util" in user.content
    )
