"""`cad.modeling`: write a CadQuery script that builds a described part; the sandbox builds it with the
real OpenCASCADE kernel and the grader compares its volume with the target's.

Tasks are procedural parts described in text with dimensions in mm, by level: 0 = a block or a cylinder
(the prompt carries worked examples), 1 = a plate with holes, a tube, a block with a bore, 2 = an
L-bracket, a flange with a bolt circle, a stepped shaft, 3 = an open enclosure with a window, a gear
blank with a hub, a plate with rounded corners and holes. Each task's reference is a CadQuery script.
The option `brief` says how the first observation gives the part: `text` (default), `drawing` (its
engineering drawing, cad_drawing.py, as an image part whose text description is the text brief) or
`both`; the grading does not depend on it.

A reply's script (the last ```python block naming its part, else the last block, else the whole reply
if it parses as Python) runs in the sandbox's warm `cad` profile (`cad_runner`, with `cq` bound): its
part, in CadQuery's conventions, is what it assigns to `result`, else what it passes to `show_object`,
else its one top-level Workplane or Shape variable holding a solid; a function never called builds no
part. The mesh it returns is compared with the target's (the reference, run the same
way once per task): `iou` = volume IoU of the two voxelised solids, each centred on its bounding box, in
mm (`cad_geometry` documents the normalisation and how it differs from CAD-Recode's, which `iou_unit` and
`chamfer` follow; those two are reported in `info`, not rewarded). Reward = 0.9 * iou + 0.1 * format for
a valid solid, else 0 with `info["reason"]` (a syntax or runtime error, a timeout, memory, no `result`,
no solid, an unusable mesh); `format` = the script came from a ```python block that assigns `result` or calls `show_object`;
`valid` = a solid came back. `success` is strict: iou >= SUCCESS_IOU.

Multi-turn (`max_turns`, default 3): after a submission that is not a success, the next observation
holds the execution log or error, the part's measured properties against the target's, and an image
(target, the part, their overlap in three orthographic views) whose description a text-only model
reads. The episode's reward is its last submission's. Residual risk: the grade is of the mesh the job
returns, so a script that writes a correct mesh without CadQuery is graded on that mesh; the report's
B-rep figures (faces, validity) are the script's own account and are shown, never scored.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from posttrain.envs.base import Domain, Environment, Observation, StepResult
from posttrain.envs.domains import cad_geometry as geo
from posttrain.envs.domains.cad_drawing import DESCRIPTION as DRAWING_DESCRIPTION
from posttrain.envs.domains.cad_drawing import mm_text, render_part
from posttrain.envs.extract import code_blocks
from posttrain.envs.images import image_part
from posttrain.envs.registry import register_env
from posttrain.sandbox.api import ExecResult, ExecStatus, Job, Limits
from posttrain.types import ContentPart, ImagePart, Message, Task, TextPart

W_IOU, W_FORMAT = 0.9, 0.1
SUCCESS_IOU = 0.95
MAX_CODE_CHARS = 20_000
MAX_LOG_CHARS = 600
RESULT_NAME = "result"
SHOW_NAME = "show_object"
PROFILE = "cad"
JOB_LIMITS = Limits(
    wall_time_s=10.0,
    cpu_time_s=10.0,
    memory_bytes=1 << 30,
    max_output_bytes=64 * 1024,
    max_file_bytes=16 << 20,
    max_returned_files_bytes=8 << 20,
)
TARGET_CACHE_SIZE = 1024
INSTALL_HINT = (
    "domain 'cad.modeling' needs CadQuery, which is not importable here: install the cad extra "
    "(pip install 'posttrain[cad]': cadquery and its OpenCASCADE wheels, cadquery-ocp)"
)
INSTRUCTION = (
    "Write a CadQuery (Python) script that builds this part. Units are millimetres; x is length, y is "
    "width, z is height. Assign the finished solid to a variable named `result`. Reply with the script "
    "in one ```python code block."
)
# Level 0's worked example, given as an earlier exchange: a part of the task's own family with other
# numbers, so that copying its form and changing the numbers solves the task. The 135M model otherwise
# wraps the part in functions it never calls, and it misspells plane names ("XYZ"), hence `Workplane()`.
EXAMPLES = {
    "box": (
        "A rectangular block 30 mm long (x), 20 mm wide (y) and 10 mm tall (z).",
        "```python\nimport cadquery as cq\nresult = cq.Workplane().box(30, 20, 10)\n```",
    ),
    "cylinder": (
        "A solid cylinder 24 mm in diameter and 16 mm tall, its axis along z.",
        "```python\nimport cadquery as cq\nresult = cq.Workplane().circle(12).extrude(16)\n```",
    ),
}
EXAMPLE_KEYS = {("box", (30, 20, 10)), ("cylinder", (24, 16))}
BRIEFS = ("text", "drawing", "both")
DRAWING_NOTE = (
    "engineering drawing, third-angle projection: top view above the front view, right side view to its right"
)


def cadquery_available() -> bool:
    return importlib.util.find_spec("cadquery") is not None


@lru_cache(maxsize=1)
def runner_source() -> str:
    return (Path(__file__).parent / "cad_runner.py").read_text()


# ---- part families ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    family: str
    dims: tuple[Any, ...]  # the generator's draw: the task's identity
    description: str
    code: str  # the reference CadQuery script


def _script(body: str) -> str:
    return f"import cadquery as cq\n{RESULT_NAME} = {body}\n"


def _box(rng: random.Random) -> Part:
    dims = (rng.randint(8, 80), rng.randint(8, 80), rng.randint(4, 50))
    x, y, z = dims
    desc = f"A rectangular block {x} mm long (x), {y} mm wide (y) and {z} mm tall (z)."
    return Part("box", dims, desc, _script(f'cq.Workplane("XY").box({x}, {y}, {z})'))


def _cylinder(rng: random.Random) -> Part:
    dims = (2 * rng.randint(4, 40), rng.randint(4, 60))
    d, h = dims
    desc = f"A solid cylinder {d} mm in diameter and {h} mm tall, its axis along z."
    return Part("cylinder", dims, desc, _script(f'cq.Workplane("XY").circle({mm_text(d / 2)}).extrude({h})'))


def _plate_with_holes(rng: random.Random) -> Part:
    length, width, t = rng.randint(40, 120), rng.randint(30, 80), rng.randint(3, 10)
    d = rng.randint(3, min(10, width // 6))
    # hole centres at least a diameter from the edges and from each other
    ax, ay = rng.randint(d, length // 2 - d), rng.randint(d, width // 2 - d)
    pattern = rng.choice(["pair", "corners"])
    points = [(-ax, 0), (ax, 0)] if pattern == "pair" else [(-ax, -ay), (ax, -ay), (-ax, ay), (ax, ay)]
    where = ", ".join(f"({px}, {py})" for px, py in points)
    desc = (
        f"A rectangular plate {length} mm long (x), {width} mm wide (y) and {t} mm thick (z) with "
        f"{len(points)} through-holes of {d} mm diameter along z, their centres at (x, y) = {where} mm "
        "from the plate's centre."
    )
    body = (
        f'cq.Workplane("XY").box({length}, {width}, {t}).faces(">Z").workplane()'
        f".pushPoints([{where}]).hole({d})"
    )
    return Part("plate_with_holes", (length, width, t, d, tuple(points)), desc, _script(body))


def _tube(rng: random.Random) -> Part:
    od, wall, h = 2 * rng.randint(8, 40), rng.randint(2, 8), rng.randint(10, 60)
    wall = min(wall, od // 2 - 2)
    inner = od - 2 * wall
    desc = (
        f"A tube (a hollow cylinder) {h} mm long with outer diameter {od} mm and inner diameter "
        f"{inner} mm, its axis along z."
    )
    body = f'cq.Workplane("XY").circle({mm_text(od / 2)}).circle({mm_text(inner / 2)}).extrude({h})'
    return Part("tube", (od, inner, h), desc, _script(body))


def _block_with_bore(rng: random.Random) -> Part:
    x, y, z = rng.randint(20, 80), rng.randint(20, 80), rng.randint(8, 40)
    d = rng.randint(4, min(x, y) - 6)
    desc = (
        f"A block {x} mm long (x), {y} mm wide (y) and {z} mm tall (z) with a {d} mm diameter hole "
        "through its centre along z."
    )
    body = f'cq.Workplane("XY").box({x}, {y}, {z}).faces(">Z").workplane().hole({d})'
    return Part("block_with_bore", (x, y, z, d), desc, _script(body))


def _l_bracket(rng: random.Random) -> Part:
    t = rng.randint(3, 10)
    a, b, w = rng.randint(3 * t, 90), rng.randint(3 * t, 70), rng.randint(10, 60)
    desc = (
        f"An L-bracket {w} mm wide (y): a horizontal leg {a} mm long (x) and a vertical leg {b} mm tall "
        f"(z), both {t} mm thick, meeting at one end, so that its cross-section in the XZ plane is an L "
        f"(outer corner at the origin; the vertical leg on the x = 0 side)."
    )
    pts = [(0, 0), (a, 0), (a, t), (t, t), (t, b), (0, b)]
    body = f'cq.Workplane("XZ").polyline({pts}).close().extrude({w})'
    return Part("l_bracket", (a, b, t, w), desc, _script(body))


def _flange(rng: random.Random) -> Part:
    d_out = 2 * rng.randint(25, 60)
    bore = 2 * rng.randint(5, d_out // 6)
    hole = rng.randint(4, 10)
    bolt = 2 * round((d_out / 2 + bore / 2) / 2)  # bolt circle diameter: midway between bore and rim
    n, t = rng.randint(3, 8), rng.randint(5, 15)
    desc = (
        f"A flange: a disc {d_out} mm in diameter and {t} mm thick (z) with a {bore} mm central bore, and "
        f"{n} bolt holes of {hole} mm diameter evenly spaced on a {bolt} mm bolt circle, the first "
        "one on the +x axis; all holes go through along z."
    )
    body = (
        f'cq.Workplane("XY").circle({mm_text(d_out / 2)}).circle({mm_text(bore / 2)}).extrude({t})'
        f'.faces(">Z").workplane().polarArray({mm_text(bolt / 2)}, 0, 360, {n}).hole({hole})'
    )
    return Part("flange", (d_out, bore, hole, bolt, n, t), desc, _script(body))


def _stepped_shaft(rng: random.Random) -> Part:
    n = rng.randint(2, 3)
    diameters = sorted(rng.sample(range(6, 41, 2), n), reverse=True)
    lengths = [rng.randint(8, 40) for _ in range(n)]
    sections = ", then ".join(
        f"a {d} mm diameter section {length} mm long" for d, length in zip(diameters, lengths, strict=True)
    )
    desc = f"A stepped shaft along z, coaxial sections from the bottom up: {sections}."
    body = f'cq.Workplane("XY").circle({mm_text(diameters[0] / 2)}).extrude({lengths[0]})'
    for d, length in zip(diameters[1:], lengths[1:], strict=True):
        body += f'.faces(">Z").workplane().circle({mm_text(d / 2)}).extrude({length})'
    return Part("stepped_shaft", (tuple(diameters), tuple(lengths)), desc, _script(body))


def _enclosure(rng: random.Random) -> Part:
    x, y, z = rng.randint(40, 100), rng.randint(30, 80), rng.randint(20, 60)
    t = rng.randint(2, 4)
    a, b = rng.randint(8, x // 2), rng.randint(5, z // 2)
    desc = (
        f"An open-top box (enclosure) {x} mm long (x), {y} mm wide (y) and {z} mm tall (z) with walls "
        f"and floor {t} mm thick, and a rectangular window {a} mm wide (x) and {b} mm high (z) cut "
        "through the front wall (the -y side), centred on that wall."
    )
    body = (
        f'cq.Workplane("XY").box({x}, {y}, {z}).faces(">Z").shell(-{t})'
        f'.faces("<Y").workplane(centerOption="CenterOfBoundBox").rect({a}, {b}).cutBlind(-{t})'
    )
    return Part("enclosure", (x, y, z, t, a, b), desc, _script(body))


def _gear_blank(rng: random.Random) -> Part:
    d_out = 2 * rng.randint(20, 50)
    hub = 2 * rng.randint(6, d_out // 4)
    bore = 2 * rng.randint(2, hub // 2 - 2)
    t, th = rng.randint(5, 15), rng.randint(4, 15)
    desc = (
        f"A gear blank: a disc {d_out} mm in diameter and {t} mm thick (z), with a hub {hub} mm in "
        f"diameter standing {th} mm above its top face, and a {bore} mm bore through disc and hub along z."
    )
    body = (
        f'cq.Workplane("XY").circle({mm_text(d_out / 2)}).extrude({t}).faces(">Z").workplane()'
        f'.circle({mm_text(hub / 2)}).extrude({th}).faces(">Z").workplane().hole({bore})'
    )
    return Part("gear_blank", (d_out, hub, bore, t, th), desc, _script(body))


def _rounded_plate(rng: random.Random) -> Part:
    x, y, t = rng.randint(40, 120), rng.randint(30, 80), rng.randint(4, 12)
    r = rng.randint(3, min(x, y) // 5)
    d = rng.randint(3, max(3, min(8, (min(x, y) // 2 - r) // 2)))  # holes clear of the corners and each other
    ax, ay = x // 2 - r - d, y // 2 - r - d
    desc = (
        f"A plate {x} mm long (x), {y} mm wide (y) and {t} mm thick (z) whose four vertical corner edges "
        f"are rounded with a {r} mm radius, with four {d} mm through-holes along z at (x, y) = "
        f"(-{ax}, -{ay}), ({ax}, -{ay}), (-{ax}, {ay}), ({ax}, {ay}) mm from its centre."
    )
    body = (
        f'cq.Workplane("XY").box({x}, {y}, {t}).edges("|Z").fillet({r}).faces(">Z").workplane()'
        f".pushPoints([(-{ax}, -{ay}), ({ax}, -{ay}), (-{ax}, {ay}), ({ax}, {ay})]).hole({d})"
    )
    return Part("rounded_plate", (x, y, t, r, d), desc, _script(body))


FAMILIES: dict[int, list[Callable[[random.Random], Part]]] = {
    0: [_box, _cylinder],
    1: [_plate_with_holes, _tube, _block_with_bore],
    2: [_l_bracket, _flange, _stepped_shaft],
    3: [_enclosure, _gear_blank, _rounded_plate],
}


def drawing_part(family: str, dims: tuple[Any, ...], description: str) -> ImagePart:
    """A part's engineering drawing as an image part; `description` is what a text-only model reads."""
    return image_part(render_part(family, dims).pixels, description)


def brief_content(
    family: str, dims: tuple[Any, ...], description: str, brief: str
) -> str | list[ContentPart]:
    """A user turn asking for one part in a `brief`'s form: the text (`text`); the drawing, whose
    description for a text-only model is the text brief (`drawing`); or the text and the drawing (`both`)."""
    if brief == "text":
        return f"{INSTRUCTION}\n\nThe part: {description}"
    if brief == "drawing":
        return [
            TextPart(INSTRUCTION),
            TextPart(f"The part ({DRAWING_NOTE}):"),
            drawing_part(family, dims, description),
        ]
    return [
        TextPart(INSTRUCTION),
        TextPart(f"The part: {description}\nIts drawing ({DRAWING_NOTE}):"),
        drawing_part(family, dims, DRAWING_DESCRIPTION),
    ]


def prompt_messages(part: Part, difficulty: int, brief: str) -> list[Message]:
    """The task's first turns. At level 0 a worked example of the task's own family comes first as an
    earlier exchange (the example part asked in the brief's form, its script as the assistant's reply),
    then the part; at other levels the part alone."""
    ask = Message("user", brief_content(part.family, part.dims, part.description, brief))
    if difficulty != 0:
        return [ask]
    example, code = EXAMPLES[part.family]
    dims = next(d for f, d in EXAMPLE_KEYS if f == part.family)
    return [
        Message("user", brief_content(part.family, dims, example, brief)),
        Message("assistant", code),
        ask,
    ]


# ---- grading ------------------------------------------------------------------------------------------


@dataclass
class Solid:
    """What came back from one script: the mesh (trusted only as data) and the runner's report. The
    unit-normalised voxels and samples are computed once (a target is compared with many parts)."""

    mesh: geo.Mesh
    report: dict[str, Any]
    volume_mm3: float
    watertight: bool

    @cached_property
    def unit_voxels(self) -> Any:
        return geo.unit_voxels(self.mesh)

    @cached_property
    def unit_points(self) -> Any:
        return geo.unit_points(self.mesh)


@dataclass
class Built:
    """One script's run: a solid, or the reason there is none. `infra` marks a sandbox failure."""

    solid: Solid | None
    status: str
    reason: str = ""
    log: str = ""
    infra: bool = False


def script_of(text: str) -> tuple[str | None, float, str]:
    """(code, format, reason): the last ```python block that names its part (assigns `result` or calls
    `show_object`; format 1), else the last block, else the whole reply when it parses as Python
    (format 0), else None with why."""
    if not isinstance(text, str) or not text.strip():
        return None, 0.0, "empty reply"
    blocks = code_blocks(text, "python")
    naming = [b for b in blocks if names_part(b)]
    if naming:
        return naming[-1], 1.0, ""
    if blocks:
        return blocks[-1], 0.0, ""
    try:
        ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None, 0.0, "no ```python code block in the reply"
    return text, 0.0, ""


def names_part(code: str) -> bool:
    """Whether `code` names its part in one of CadQuery's conventions at the top level: it assigns
    `result`, or it calls `show_object(...)` (the runner also takes a lone solid variable, unnamed)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Name) and func.id == SHOW_NAME:
                return True
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == RESULT_NAME for t in targets):
            return True
    return False


def cad_job(code: str) -> Job:
    return Job(
        code=runner_source(),
        files={"part.py": code.encode("utf-8", "surrogateescape")},
        limits=JOB_LIMITS,
        profile=PROFILE,
    )


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_LOG_CHARS else "..." + text[-MAX_LOG_CHARS:]


def read_build(res: ExecResult) -> Built:
    """Turn a job's result into a solid or a stated reason (never raises on what the job returned)."""
    log = _tail(res.stdout_text + ("\n" if res.stdout and res.stderr else "") + res.stderr_text)
    status = res.status.value
    if res.is_infra_failure:
        return Built(None, status, f"sandbox failure: {res.error}", log, infra=True)
    if res.status == ExecStatus.TIMEOUT:
        return Built(None, status, f"the script ran past the {JOB_LIMITS.wall_time_s:g} s limit", log)
    if res.status == ExecStatus.MEMORY_EXCEEDED:
        return Built(None, status, "the script ran out of memory", log)
    if res.status == ExecStatus.OUTPUT_TRUNCATED:
        return Built(None, status, "the script printed more output than allowed", log)
    try:
        report = json.loads(res.files.get("cad_report.json", b"").decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        report = None
    if not isinstance(report, dict):
        why = (
            "the script did not finish (no report)"
            if res.status == ExecStatus.OK
            else f"the job ended {status}"
        )
        return Built(None, status, why, log)
    if not report.get("ok"):
        return Built(None, status, str(report.get("error", "failed"))[:MAX_LOG_CHARS], log)
    try:
        mesh = geo.parse_mesh(res.files.get("cad_mesh.f32", b""), res.files.get("cad_mesh.i32", b""))
    except geo.MeshError as err:
        return Built(None, status, f"unusable mesh: {err}", log)
    volume = geo.mesh_volume(mesh)
    if volume <= 0:
        return Built(None, status, "the part encloses no volume", log)
    return Built(Solid(mesh, report, volume, geo.is_watertight(mesh)), status, "", log)


_TARGETS: OrderedDict[str, Solid] = OrderedDict()


async def target_solid(sandbox: Any, code: str) -> Built:
    """The reference script's solid, built once per script and process (LRU of TARGET_CACHE_SIZE)."""
    solid = _TARGETS.get(code)
    if solid is not None:
        _TARGETS.move_to_end(code)
        return Built(solid, "ok")
    try:
        built = read_build(await sandbox.run(cad_job(code)))
    except Exception as err:  # noqa: BLE001 - a sandbox that raises is infrastructure
        return Built(None, "sandbox_error", f"sandbox failure: {type(err).__name__}: {err}", infra=True)
    if built.solid is None:  # the reference must build: anything else is the machine's fault
        return Built(None, built.status, f"the reference part did not build: {built.reason}", built.log, True)
    _TARGETS[code] = built.solid
    while len(_TARGETS) > TARGET_CACHE_SIZE:
        _TARGETS.popitem(last=False)
    return built


@dataclass
class Graded:
    """One reply's score and what the feedback shows: the build, the comparison, the target."""

    reward: float
    rewards: dict[str, float]
    info: dict[str, Any]
    built: Built | None = None
    comparison: geo.Comparison | None = None
    target: Solid | None = None


def measure(target: Solid, produced: Solid) -> tuple[geo.Comparison, dict[str, float]]:
    """The reward's comparison and the reported metrics (CAD-Recode-normalised IoU and Chamfer)."""
    return geo.compare(target.mesh, produced.mesh), {
        "iou_unit": geo.iou_of(target.unit_voxels, produced.unit_voxels),
        "chamfer": geo.chamfer_of(target.unit_points, produced.unit_points),
    }


async def grade(sandbox: Any, task: Task, text: str) -> Graded:
    """Score one reply against the task's target; `info["infra_failure"]` when the sandbox failed."""
    code, fmt, why = script_of(text)
    if code is not None and len(code) > MAX_CODE_CHARS:
        code, why = None, f"the script is longer than {MAX_CODE_CHARS} characters"
    target = await target_solid(sandbox, task.meta["reference_code"])
    if target.infra:
        return Graded(0.0, {}, {"infra_failure": True, "infra_error": target.reason[:500]})
    assert target.solid is not None
    zero = {"iou": 0.0, "format": fmt, "valid": 0.0, "success": 0.0}
    if code is None:
        return Graded(0.0, zero, {"reason": why, "status": "not_run"}, None, None, target.solid)
    try:
        built = read_build(await sandbox.run(cad_job(code)))
    except Exception as err:  # noqa: BLE001
        return Graded(0.0, {}, {"infra_failure": True, "infra_error": f"{type(err).__name__}: {err}"[:500]})
    if built.infra:
        return Graded(0.0, {}, {"infra_failure": True, "infra_error": built.reason[:500]})
    info: dict[str, Any] = {"status": built.status, "target_volume_mm3": target.solid.volume_mm3}
    if built.solid is None:
        return Graded(0.0, zero, {**info, "reason": built.reason}, built, None, target.solid)
    try:
        cmp, metrics = await asyncio.to_thread(measure, target.solid, built.solid)
    except geo.MeshError as err:
        return Graded(0.0, zero, {**info, "reason": f"unusable mesh: {err}"}, built, None, target.solid)
    iou = cmp.iou
    rewards = {"iou": iou, "format": fmt, "valid": 1.0, "success": float(iou >= SUCCESS_IOU)}
    info.update(
        iou=iou,
        **metrics,
        volume_mm3=built.solid.volume_mm3,
        watertight=built.solid.watertight,
        faces=built.solid.report.get("faces"),
    )
    return Graded(W_IOU * iou + W_FORMAT * fmt, rewards, info, built, cmp, target.solid)


# ---- feedback -----------------------------------------------------------------------------------------


def _bbox(mesh: geo.Mesh) -> str:
    return " x ".join(f"{v:.1f}" for v in mesh.extent) + " mm"


def feedback(graded: Graded, turn: int) -> Message:
    """The observation after a submission: what happened, measured properties against the target's,
    and the render (target / part / overlap) as an image with its text description."""
    target = graded.target
    assert target is not None
    built, lines = graded.built, []
    if built is None or built.solid is None:
        reason = graded.info.get("reason", "no part")
        lines.append(f"Submission {turn}: no valid solid ({reason}).")
    else:
        lines.append(f"Submission {turn}: the script ran and built a solid.")
    if built is not None and built.log:
        lines.append(f"Log:\n{built.log}")
    t_faces = target.report.get("faces")
    if built is not None and built.solid is not None:
        s = built.solid
        lines.append(
            f"Measured: bounding box {_bbox(s.mesh)} (target {_bbox(target.mesh)}); volume "
            f"{s.volume_mm3:.0f} mm^3 (target {target.volume_mm3:.0f}); watertight "
            f"{'yes' if s.watertight else 'no'}; {s.report.get('faces')} faces (target {t_faces}); "
            f"IoU with the target {graded.rewards['iou']:.2f} (success needs {SUCCESS_IOU})."
        )
    else:
        lines.append(
            f"Target: bounding box {_bbox(target.mesh)}, volume {target.volume_mm3:.0f} mm^3, {t_faces} faces."
        )
    lines.append("Fix the script and reply with the whole corrected script in one ```python block.")
    cmp = graded.comparison
    if cmp is not None:
        pixels = geo.render_comparison(cmp.target_voxels, cmp.produced_voxels)
        what = f"render of your part next to the target (IoU {cmp.iou:.2f})"
    else:
        pixels = geo.render_comparison(geo.voxels_of(target.mesh), None)
        what = "render of the target (your script built no part)"
    img = image_part(pixels, f"{what}; {geo.RENDER_CAPTION}")
    return Message("user", [TextPart("\n".join(lines)), img])


class CadEnv(Environment):
    """One episode: up to `max_turns` submissions; ends at the first success or the last turn."""

    def __init__(self, sandbox: Any, max_turns: int) -> None:
        self.sandbox = sandbox
        self.max_turns = max_turns
        self.task: Task | None = None
        self.turn = 0
        self.last: Graded | None = None
        self.ious: list[float] = []

    async def reset(self, task: Task) -> Observation:
        self.task, self.turn, self.last, self.ious = task, 0, None, []
        return Observation(list(task.prompt))

    def _result(self, graded: Graded, done: bool, truncated: bool = False) -> StepResult:
        info = {"infra_failure": False, **graded.info, "turns": self.turn, "iou_per_turn": list(self.ious)}
        if truncated:
            info["truncated"] = True
        return StepResult([], graded.reward if done else None, done, dict(graded.rewards), info)

    async def step(self, assistant_text: str) -> StepResult:
        assert self.task is not None, "reset() first"
        self.turn += 1
        graded = await grade(self.sandbox, self.task, assistant_text)
        if graded.info.get("infra_failure"):
            return StepResult([], None, True, {}, {**graded.info, "turns": self.turn})
        self.last = graded
        self.ious.append(graded.rewards["iou"])
        if graded.rewards["success"] == 1.0 or self.turn >= self.max_turns:
            return self._result(graded, True)
        result = self._result(graded, False)
        result.observations = [feedback(graded, self.turn)]
        return result

    async def finalize(self) -> StepResult:
        """Stopped early by the caller: the last submission stands (an episode without one scores 0)."""
        if self.last is None:
            return await self.step("")
        return self._result(self.last, True, truncated=True)


@register_env("cad.modeling")
class CadModelingDomain(Domain):
    difficulties = [0, 1, 2, 3]
    requires_sandbox = True
    description = "CadQuery scripts built by OpenCASCADE in the sandbox; volume IoU; render feedback"

    def __init__(self, max_turns: int = 3, brief: str = "text") -> None:
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"cad.modeling: max_turns must be an integer >= 1, got {max_turns!r}")
        if brief not in BRIEFS:
            raise ValueError(
                f"cad.modeling: brief must be one of {', '.join(BRIEFS)} (the part described in text, as an "
                f"engineering drawing, or both), got {brief!r}"
            )
        self.max_turns = max_turns
        self.brief = brief

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        if not cadquery_available():
            raise ValueError(INSTALL_HINT)

        def make(rng: random.Random):
            part = rng.choice(FAMILIES[difficulty])(rng)
            key = f"{part.family}|{part.dims}"

            def build() -> Task | None:
                if (part.family, part.dims) in EXAMPLE_KEYS:
                    return None  # the worked examples are not tasks
                meta = {
                    "family": part.family,
                    "description": part.description,
                    "reference_code": part.code,
                    "brief": self.brief,
                    "dims": json.loads(json.dumps(part.dims)),  # the draw, which the drawing shows
                }
                return Task(
                    id="",
                    domain=self.name,
                    difficulty=difficulty,
                    prompt=prompt_messages(part, difficulty, self.brief),
                    meta=meta,
                )

            return key, build

        return self.draw(split, difficulty, index, seed, make)

    def reference(self, task: Task) -> list[str]:
        return [f"```python\n{task.meta['reference_code'].rstrip()}\n```"]

    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> Environment:
        if sandbox is None:
            raise ValueError(
                "domain 'cad.modeling' runs CadQuery in the sandbox: pass a sandbox to make_env "
                "(posttrain.sandbox.make_sandbox(cfg))"
            )
        return CadEnv(sandbox, self.max_turns)
