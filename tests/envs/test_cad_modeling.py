"""cad.modeling: the warm `cad` sandbox profile, the geometry (voxel IoU, Chamfer, renders) against
hand-computed values, the domain's contract (deterministic generators, disjoint splits, references
scoring 1.0), wrong and hostile scripts scored 0 with their reason and the sandbox's status, and the
multi-turn feedback with its render."""

from __future__ import annotations

import dataclasses
import io
import os
import random
import time

import numpy as np
import pytest

from posttrain.envs import get_domain, run_episode
from posttrain.envs.base import split_of
from posttrain.envs.domains import cad_geometry as geo
from posttrain.envs.domains import cad_modeling as cad
from posttrain.envs.images import encode_png
from posttrain.sandbox.api import ExecStatus, Job, Limits
from posttrain.types import ImagePart, Message

from .conftest import run

needs_cad = pytest.mark.skipif(not cad.cadquery_available(), reason=cad.INSTALL_HINT)


def _reply(code: str) -> str:
    return f"```python\n{code}\n```"


# ---- geometry (pure numpy) ----------------------------------------------------------------------------


def test_iou_of_a_part_with_itself_is_one_and_with_a_shifted_copy_the_overlap_over_the_union():
    a = geo.box_mesh((40, 20, 10))
    shifted = geo.box_mesh((40, 20, 10), centre=(10, 0, 0))
    assert geo.compare(a, a).iou == 1.0
    # where they are: overlap 30 x 20 x 10 over union 50 x 20 x 10 (the pitch divides every edge)
    assert geo.compare(a, shifted, centre=False).iou == pytest.approx(30 / 50, abs=1e-12)
    # the reward's normalisation centres both: position is not graded, size is
    assert geo.compare(a, shifted).iou == 1.0
    assert geo.compare(a, geo.box_mesh((20, 20, 10))).iou == pytest.approx(0.5, abs=1e-12)
    # CAD-Recode's unit-cube normalisation is scale-invariant: twice the size still scores 1
    assert geo.iou_unit(a, geo.box_mesh((80, 40, 20))) == 1.0
    assert geo.compare(a, geo.box_mesh((80, 40, 20))).iou == pytest.approx(1 / 8, abs=1e-12)


def test_voxel_volume_and_mesh_volume_match_the_box():
    a = geo.box_mesh((40, 20, 10), centre=(3, -2, 7))
    assert geo.mesh_volume(a) == pytest.approx(8000.0)
    cmp = geo.compare(a, a)
    assert int(cmp.target_voxels.sum()) * cmp.grid.voxel_volume == pytest.approx(8000.0)
    assert geo.is_watertight(a)
    open_box = geo.Mesh(a.vertices, a.triangles[:-2])  # one face missing
    assert not geo.is_watertight(open_box)


def test_chamfer_is_zero_for_the_same_part_and_grows_with_the_difference():
    pytest.importorskip("scipy")
    a = geo.box_mesh((40, 20, 10))
    assert geo.chamfer(a, a) == 0.0
    near, far = geo.chamfer(a, geo.box_mesh((40, 20, 12))), geo.chamfer(a, geo.box_mesh((40, 40, 40)))
    assert 0 < near < far


@pytest.mark.parametrize(
    "vertices, triangles, why",
    [
        (b"\x00" * 13, b"", "whole"),
        (np.zeros((3, 3), "<f4").tobytes(), b"", "no triangles"),
        (np.full((3, 3), np.nan, "<f4").tobytes(), np.array([[0, 1, 2]], "<i4").tobytes(), "non-finite"),
        (np.zeros((3, 3), "<f4").tobytes(), np.array([[0, 1, 7]], "<i4").tobytes(), "outside its vertex"),
        (np.full((3, 3), 1e9, "<f4").tobytes(), np.array([[0, 1, 2]], "<i4").tobytes(), "beyond"),
    ],
)
def test_bad_mesh_bytes_are_refused_with_the_reason(vertices, triangles, why):
    with pytest.raises(geo.MeshError, match=why):
        geo.parse_mesh(vertices, triangles)


def test_a_mesh_of_huge_overlapping_triangles_is_refused_not_voxelised_for_minutes():
    # each triangle covers most columns of a 160^3 grid seen from any axis: 3000 of them ask for
    # about 50 million ray-triangle tests
    big = np.array([[-1e5, -1e5, -1e5], [1e5, -1e5, 1e5], [-1e5, 1e5, 1e5]], dtype=np.float64)
    mesh = geo.Mesh(np.tile(big, (3000, 1)), np.arange(9000).reshape(-1, 3))
    grid = geo.grid_around(np.full(3, -1e5), np.full(3, 1e5), 1.0)
    assert grid.shape == (160, 160, 160)
    with pytest.raises(geo.MeshError, match="too costly"):
        geo.voxelize(mesh, grid)


def test_renders_are_pngs_of_the_stated_size_and_differ_when_the_part_differs():
    from PIL import Image

    a, b = geo.box_mesh((40, 20, 10)), geo.box_mesh((20, 20, 30))
    same, other = geo.compare(a, a), geo.compare(a, b)
    img_same = geo.render_comparison(same.target_voxels, same.produced_voxels)
    img_other = geo.render_comparison(other.target_voxels, other.produced_voxels)
    height = geo.HEADER_H_PX + 3 * (geo.PANEL_PX + geo.GUTTER_PX)
    width = geo.LABEL_W_PX + 3 * (geo.PANEL_PX + geo.GUTTER_PX)
    assert img_same.shape == img_other.shape == (height, width, 3)
    part = ImagePart(encode_png(img_other), "x")
    assert part.size == (width, height)
    assert Image.open(io.BytesIO(part.png)).size == (width, height)
    assert not np.array_equal(img_same, img_other)
    overlap_row = img_same[geo.HEADER_H_PX + 2 * (geo.PANEL_PX + geo.GUTTER_PX) :]
    for colour in (geo.OVERLAP_COLOURS["yours"], geo.OVERLAP_COLOURS["target"]):
        assert not (overlap_row == colour).all(axis=-1).any()  # identical parts: no red, no blue
    assert (overlap_row == geo.OVERLAP_COLOURS["both"]).all(axis=-1).any()


# ---- the domain ---------------------------------------------------------------------------------------


@needs_cad
def test_generators_are_deterministic_and_splits_disjoint():
    d = get_domain("cad.modeling")
    for level in d.difficulties:
        assert d.task("train", level, 2, seed=5).to_dict() == d.task("train", level, 2, seed=5).to_dict()
        keys = {}
        for split in ("train", "heldout"):
            tasks = [d.task(split, level, i) for i in range(30)]
            assert all(split_of(t.meta["content_key"]) == split for t in tasks)
            keys[split] = {t.meta["content_key"] for t in tasks}
        assert keys["train"] and keys["heldout"] and not keys["train"] & keys["heldout"]
    assert d.task("train", 0, 0, seed=0).prompt != d.task("train", 0, 0, seed=1).prompt
    families = {d.task("train", lvl, i).meta["family"] for lvl in d.difficulties for i in range(40)}
    assert families == {fam(random.Random(0)).family for fs in cad.FAMILIES.values() for fam in fs}


@needs_cad
def test_level_zero_prompts_carry_the_worked_examples_as_an_earlier_exchange_and_never_ask_for_them():
    d = get_domain("cad.modeling")
    for i in range(40):
        task = d.task("train", 0, i)
        brief, code = cad.EXAMPLES[task.meta["family"]]  # an example of the task's own family
        ask_example, answer, ask = task.prompt
        assert [m.role for m in task.prompt] == ["user", "assistant", "user"]
        assert ask_example.text.endswith(f"The part: {brief}") and answer.content == code
        assert ask.text.endswith(f"The part: {task.meta['description']}")
        assert task.meta["description"] != brief
    (one,) = d.task("train", 1, 0).prompt
    assert one.role == "user" and one.text.startswith(cad.INSTRUCTION) and "Example" not in one.text


def test_without_cadquery_the_domain_says_which_extra_to_install(monkeypatch):
    monkeypatch.setattr(cad, "cadquery_available", lambda: False)
    d = get_domain("cad.modeling")  # listing it still works
    with pytest.raises(ValueError, match=r"posttrain\[cad\]"):
        d.task("train", 0, 0)
    from typer.testing import CliRunner

    from posttrain.cli import app

    out = CliRunner().invoke(app, ["tasks", "sample", "cad.modeling"])
    assert out.exit_code == 2 and "needs CadQuery" in out.output and "posttrain[cad]" in out.output


def test_replies_without_a_script_are_refused_before_the_sandbox():
    assert cad.script_of("") == (None, 0.0, "empty reply")
    assert cad.script_of("I would use a box.")[2] == "no ```python code block in the reply"
    code, fmt, _ = cad.script_of('import cadquery as cq\nresult = cq.Workplane("XY").box(1, 2, 3)')
    assert fmt == 0.0 and code is not None  # bare code runs, without the format credit
    two = _reply("x = 1") + "\n" + _reply("result = 2") + "\n" + _reply("y = 3")
    assert cad.script_of(two) == ("result = 2\n", 1.0, "")


@pytest.fixture
def cad_only_sandbox():
    """A sandbox that runs cad-profile jobs only: `worker_info` is the last worker to start, and the session
    sandbox's default-profile pools respawn workers in the background (more often with parallel tests)."""
    from posttrain.sandbox import LocalSandbox, SandboxUnavailable

    try:
        sb = LocalSandbox(pool_size=1)
    except SandboxUnavailable as err:
        pytest.skip(f"sandbox unavailable on this machine: {err}")
    yield sb
    sb.close_blocking()


@needs_cad
def test_the_cad_profile_is_warm(cad_only_sandbox):
    sandbox = cad_only_sandbox
    job = Job(
        code="import cadquery as cq\nprint(cq.Workplane('XY').box(1, 2, 3).val().Volume())",
        profile="cad",
        limits=Limits(wall_time_s=30, cpu_time_s=30),
    )
    first = sandbox.run_blocking(job)
    assert first.status == ExecStatus.OK and float(first.stdout_text) == pytest.approx(6.0), first
    assert "cadquery" in sandbox.worker_info["preloaded"]
    walls = [sandbox.run_blocking(job).wall_ms for _ in range(3)]
    assert sorted(walls)[1] < 1000, walls  # the import alone takes over a second on this machine


@needs_cad
def test_references_score_one_at_every_level(sandbox):
    d = get_domain("cad.modeling")
    for level in d.difficulties:
        for split in d.splits:
            task = d.task(split, level, 0)
            res = run(run_episode(d.make_env(sandbox), task, d.reference(task)))
            assert res.done and res.reward == 1.0, (task.id, res.rewards, res.info)
            assert res.rewards == {"iou": 1.0, "format": 1.0, "valid": 1.0, "success": 1.0}
            assert res.info["turns"] == 1 and res.info["chamfer"] == 0.0


def _first_task():
    return get_domain("cad.modeling").task("train", 0, 0)  # a block 32 x 16 x 39 mm


@needs_cad
def test_a_wrong_part_scores_its_iou_and_a_right_one_built_differently_succeeds(sandbox):
    task = _first_task()
    assert "32 mm long (x), 16 mm wide (y) and 39 mm tall (z)" in task.prompt[-1].text
    env = cad.CadEnv(sandbox, max_turns=1)
    half = 'import cadquery as cq\nresult = cq.Workplane("XY").box(16, 16, 39)'
    res = run(run_episode(env, task, [_reply(half)]))
    assert res.rewards["success"] == 0.0 and res.rewards["valid"] == 1.0
    assert res.rewards["iou"] == pytest.approx(0.5, abs=0.02)  # half the block, up to a voxel layer
    assert res.reward == pytest.approx(0.9 * res.rewards["iou"] + 0.1)
    sketched = (
        "import cadquery as cq\nresult = cq.Workplane('XY').rect(32, 16).extrude(39).translate((100, 5, -3))"
    )
    res = run(run_episode(cad.CadEnv(sandbox, 1), task, [_reply(sketched)]))
    assert res.rewards["success"] == 1.0 and res.rewards["iou"] == 1.0


HOSTILE = [
    ("import cadquery as cq\nresult = cq.Workplane('XY').box(1, 2", "runtime_error", "SyntaxError"),
    ("raise ValueError('boom')", "runtime_error", "ValueError: boom"),
    (
        "import cadquery as cq\nsketch = cq.Workplane('XY').rect(1, 2)",
        "runtime_error",
        "did not assign `result` and builds no solid at the top level: assign the part to `result`",
    ),
    # a function that builds the part but is never called builds nothing (and is never run by the grader)
    (
        "import cadquery as cq\ndef build():\n    open('/usr/lib/posttrain-cad-pwned', 'w')\n"
        "    return cq.Workplane('XY').box(32, 16, 39)",
        "runtime_error",
        "defines `build()` but never builds a part at the top level (a function that is not called builds "
        "nothing): call it and assign the part to `result` (or pass it to `show_object`), e.g. "
        "`result = build()`",
    ),
    (  # two solids, neither named the part
        "a = cq.Workplane().box(32, 16, 39)\nb = a.faces('>Z').workplane().hole(2)",
        "runtime_error",
        "builds several solids (`a`, `b`) and names none the part",
    ),
    ("show_object(5)", "runtime_error", "the object passed to `show_object` is a int, not a CadQuery"),
    ("show_object(cq.Workplane().rect(3, 3))", "runtime_error", "the part holds no solid (a Wire only)"),
    (  # the part named, but not a solid: the unnamed solid beside it is not taken instead
        "block = cq.Workplane().box(32, 16, 39)\nresult = 'block'",
        "runtime_error",
        "`result` is a str, not a CadQuery",
    ),
    ("while True:\n    show_object(cq.Workplane().box(1, 1, 1))", "timeout", "ran past"),
    ("result = 5", "runtime_error", "is a int, not a CadQuery"),
    (
        "import cadquery as cq\nresult = cq.Workplane('XY').rect(3, 3)",
        "runtime_error",
        "the part holds no solid",
    ),
    ("import os\nos._exit(0)", "ok", "did not finish"),
    ("import sys\nsys.exit(3)", "runtime_error", "exited with status 3"),
    ("while True:\n    pass", "timeout", "ran past"),
    ("x = bytearray(10 * 1024 ** 3)", "memory_exceeded", "out of memory"),
    ("open('/usr/lib/posttrain-cad-pwned', 'w').write('x')", "runtime_error", "Read-only file system"),
    ("print('x' * 10_000_000)", "output_truncated", "more output"),
    (  # a forged report and mesh: the grader reads the mesh, and this one is not a mesh
        "import json\nimport os\njson.dump({'ok': True, 'faces': 6}, open('cad_report.json', 'w'))\n"
        "open('cad_mesh.f32', 'wb').write(b'\\xff' * 36)\nopen('cad_mesh.i32', 'wb').write(bytes(12))\n"
        "os._exit(0)",
        "ok",
        "unusable mesh: the mesh has non-finite",
    ),
]


# CadQuery's ways of saying which object is the part (`cq` is bound for the script, as the worker has it
# imported): `result`, `show_object` (CQ-editor, cq-server), or the script's one top-level solid
ACCEPTED = [
    ("result = cq.Workplane().box(32, 16, 39)", 1.0),
    (
        "import cadquery as cq\npart = cq.Workplane('XY').box(32, 16, 39)\nshow_object(part, name='block')",
        1.0,
    ),
    ("show_object(cq.Workplane().box(32, 16, 39).val(), options={'color': 'red'})", 1.0),
    ("import cadquery as cq\nblock = cq.Workplane('XY').box(32, 16, 39)", 0.0),
    ("def make(x, y, z):\n    return cq.Workplane().box(x, y, z)\n\npart = make(32, 16, 39)\nsize = 32", 0.0),
    ("solid = cq.Solid.makeBox(32, 16, 39)", 0.0),
]


@needs_cad
def test_each_of_cadquerys_conventions_for_the_part_is_graded_on_that_part(sandbox):
    task = _first_task()  # a block 32 x 16 x 39 mm
    for code, fmt in ACCEPTED:
        res = run(run_episode(cad.CadEnv(sandbox, 1), task, [_reply(code)]))
        assert res.rewards == {"iou": 1.0, "format": fmt, "valid": 1.0, "success": 1.0}, (code, res.info)
        assert res.reward == pytest.approx(0.9 + 0.1 * fmt), code
    # `result` names the part even when something else is shown: half the block scores half
    both = "result = cq.Workplane().box(16, 16, 39)\nshow_object(cq.Workplane().box(32, 16, 39))"
    res = run(run_episode(cad.CadEnv(sandbox, 1), task, [_reply(both)]))
    assert res.rewards["success"] == 0.0 and res.rewards["iou"] == pytest.approx(0.5, abs=0.02)


def test_the_block_that_names_its_part_is_the_script():
    shown = "part = cq.Workplane().box(1, 2, 3)\nshow_object(part)"
    assert cad.script_of(_reply(shown) + "\nThen:\n" + _reply("x = 1")) == (shown + "\n", 1.0, "")
    # a call inside a function is not the script's own: the last block stands, unformatted
    nested = "def f():\n    show_object(1)"
    assert cad.script_of(_reply(nested)) == (nested + "\n", 0.0, "")
    assert not cad.names_part("show_object = print") and cad.names_part("result: object = 1")


@needs_cad
def test_the_feedback_on_an_uncalled_function_says_to_call_it(sandbox):
    env = cad.CadEnv(sandbox, max_turns=2)
    task = _first_task()
    run(env.reset(task))
    step = run(env.step(_reply("def build_block():\n    return cq.Workplane().box(32, 16, 39)")))
    assert not step.done and step.rewards["valid"] == 0.0
    text = step.observations[0].text
    assert "Submission 1: no valid solid (the script defines `build_block()` but never builds" in text
    assert "e.g. `result = build_block()`" in text
    step = run(
        env.step(
            _reply("def build_block():\n    return cq.Workplane().box(32, 16, 39)\n\nresult = build_block()")
        )
    )
    assert step.done and step.rewards["success"] == 1.0


@needs_cad
def test_wrong_malformed_and_hostile_scripts_score_zero_with_their_status_and_reason(sandbox, monkeypatch):
    monkeypatch.setattr(
        cad, "JOB_LIMITS", dataclasses.replace(cad.JOB_LIMITS, wall_time_s=2.0, cpu_time_s=2.0)
    )
    task = _first_task()
    for code, status, reason in HOSTILE:
        res = run(run_episode(cad.CadEnv(sandbox, 1), task, [_reply(code)]))
        assert res.done and res.reward == 0.0 and res.rewards["valid"] == 0.0, (code, res.info)
        assert res.rewards["success"] == 0.0 and not res.info.get("infra_failure"), (code, res.info)
        assert res.info["status"] == status and reason in res.info["reason"], (code, res.info)
    assert not os.path.exists("/usr/lib/posttrain-cad-pwned")
    # the sandbox is still healthy after all that: the reference still scores 1
    res = run(run_episode(cad.CadEnv(sandbox, 1), task, get_domain("cad.modeling").reference(task)))
    assert res.reward == 1.0


@needs_cad
def test_a_failed_submission_gets_feedback_with_a_render_and_the_fix_ends_the_episode(sandbox):
    d = get_domain("cad.modeling")
    task = d.task("train", 1, 0)
    env = d.make_env(sandbox)
    assert env.max_turns == 3
    run(env.reset(task))
    wrong = run(env.step(_reply("import cadquery as cq\nresult = cq.Workplane('XY').box(10, 10, 10)")))
    assert not wrong.done and wrong.reward is None
    (msg,) = wrong.observations
    assert isinstance(msg, Message) and msg.role == "user"
    (img,) = msg.images
    assert img.size == (
        geo.LABEL_W_PX + 3 * (geo.PANEL_PX + geo.GUTTER_PX),
        geo.HEADER_H_PX + 3 * (geo.PANEL_PX + geo.GUTTER_PX),
    )
    assert "IoU with the target" in msg.text and "bounding box 10.0 x 10.0 x 10.0 mm" in msg.text
    assert "render of your part next to the target" in img.description and "[image]" in msg.text
    broken = run(env.step(_reply("raise RuntimeError('oops')")))
    (msg2,) = broken.observations
    assert "no valid solid (RuntimeError: oops)" in msg2.text and "Target: bounding box" in msg2.text
    assert "render of the target" in msg2.images[0].description
    assert msg2.images[0].png != img.png
    final = run(env.step(d.reference(task)[0]))
    assert final.done and final.reward == 1.0 and final.info["turns"] == 3
    assert final.info["iou_per_turn"][1:] == [0.0, 1.0] and 0 < final.info["iou_per_turn"][0] < 0.95


@needs_cad
def test_an_episode_stopped_early_keeps_its_last_submission(sandbox):
    task = _first_task()
    env = cad.CadEnv(sandbox, max_turns=3)
    run(env.reset(task))
    half = run(env.step(_reply('import cadquery as cq\nresult = cq.Workplane("XY").box(16, 16, 39)')))
    final = run(env.finalize())
    assert final.done and final.info["truncated"] and final.rewards["iou"] == half.rewards["iou"] > 0.4


@needs_cad
def test_a_sandbox_failure_is_infrastructure_not_a_zero():
    from .conftest import BrokenSandbox

    cad._TARGETS.clear()
    res = run(run_episode(cad.CadEnv(BrokenSandbox(), 1), _first_task(), ["```python\nresult = 1\n```"]))
    assert res.info["infra_failure"] and res.reward is None
    res = run(run_episode(cad.CadEnv(BrokenSandbox(raises=True), 1), _first_task(), [""]))
    assert res.info["infra_failure"] and "unreachable" in res.info["infra_error"]


@pytest.mark.slow
@needs_cad
def test_every_family_reference_scores_one_over_many_draws(sandbox):
    d = get_domain("cad.modeling")
    t0 = time.perf_counter()
    for level in d.difficulties:
        for i in range(12):
            task = d.task("heldout", level, i)
            res = run(run_episode(d.make_env(sandbox), task, d.reference(task)))
            assert res.reward == 1.0, (task.id, res.info)
    assert time.perf_counter() - t0 < 600
