"""The program `cad.modeling` runs in the sandbox's `cad` profile (CadQuery already imported by the warm
worker): it executes the script in `part.py`, takes its part, and writes `cad_report.json` (what
happened, B-rep properties) and the tessellated mesh (`cad_mesh.f32`, `cad_mesh.i32`) for the grader.
Its source is sent as the job's code; never imported by posttrain.

The script runs with `cq` bound to CadQuery and `show_object` defined (CQ-editor's and cq-server's
call). Its part, in CadQuery's conventions, is: what it assigned to `result`; else what it passed to
`show_object` (all shown solids together); else its one top-level Workplane or Shape variable holding a
solid. Anything else builds no part and says why (several candidates; functions defined but never
called; no solid).

Everything it writes is untrusted: the script runs in this same process and could replace any of it.
The grader recomputes what it scores from the mesh and treats the report as the script's own account.
"""

import json
import sys
import traceback

SCRIPT = "part.py"
REPORT = "cad_report.json"
VERTICES = "cad_mesh.f32"
TRIANGLES = "cad_mesh.i32"
RESULT_NAME = "result"
SHOW = "show_object"
MAX_TRIANGLES = 200_000
TOLERANCE = 1e-3  # linear deflection, as a fraction of the bounding-box diagonal
ANGULAR_TOLERANCE = 0.2  # radians


def report(**fields):
    with open(REPORT, "w") as fh:
        json.dump(fields, fh)


def fail(stage, message, code):
    report(ok=False, stage=stage, error=message[-2000:])
    sys.stdout.flush()
    sys.exit(code)


def shape_of(cq, obj, what):
    """The CadQuery Shape `obj` (a Workplane or a Shape) stands for, or a failure naming `what`."""
    if isinstance(obj, cq.Workplane):
        shapes = [v for v in obj.vals() if isinstance(v, cq.Shape)]
        if not shapes:
            fail("result", f"{what} is a Workplane holding no shape (only points or wires?)", 1)
        return shapes[0] if len(shapes) == 1 else cq.Compound.makeCompound(shapes)
    if isinstance(obj, cq.Shape):
        return obj
    fail("result", f"{what} is a {type(obj).__name__}, not a CadQuery Workplane or Shape", 1)


def has_solid(cq, obj):
    try:
        if isinstance(obj, cq.Workplane):
            return any(isinstance(v, cq.Shape) and v.Solids() for v in obj.vals())
        return isinstance(obj, cq.Shape) and bool(obj.Solids())
    except Exception:  # noqa: BLE001 - a broken object of the script's is no part
        return False


def part_of(cq, namespace, preset, shown):
    """The script's part: `result`; else the shown objects; else its one top-level solid variable."""
    if RESULT_NAME in namespace:
        return shape_of(cq, namespace[RESULT_NAME], f"`{RESULT_NAME}`")
    if shown:
        shapes = [shape_of(cq, obj, f"the object passed to `{SHOW}`") for obj in shown]
        return shapes[0] if len(shapes) == 1 else cq.Compound.makeCompound(shapes)
    names = [
        k for k, v in namespace.items() if k not in preset and not k.startswith("_") and has_solid(cq, v)
    ]
    if len(names) == 1:
        return shape_of(cq, namespace[names[0]], f"`{names[0]}`")
    fix = f"assign the part to `{RESULT_NAME}` (or pass it to `{SHOW}`)"
    if names:
        listed = ", ".join(f"`{n}`" for n in names)
        fail("result", f"the script builds several solids ({listed}) and names none the part: {fix}", 1)
    functions = [
        k
        for k, v in namespace.items()
        if k not in preset and callable(v) and getattr(v, "__module__", "") == "__main__"
    ]
    if functions:
        listed = ", ".join(f"`{n}()`" for n in functions)
        fail(
            "result",
            f"the script defines {listed} but never builds a part at the top level (a function that is "
            f"not called builds nothing): call it and {fix}, e.g. `{RESULT_NAME} = {functions[-1]}()`",
            1,
        )
    fail(
        "result", f"the script did not assign `{RESULT_NAME}` and builds no solid at the top level: {fix}", 1
    )


def main():
    import cadquery as cq
    import numpy as np

    with open(SCRIPT, encoding="utf-8", errors="replace") as fh:
        source = fh.read()
    try:
        code = compile(source, SCRIPT, "exec")
    except (SyntaxError, ValueError) as err:
        traceback.print_exception(type(err), err, None)
        fail("syntax", f"{type(err).__name__}: {err}", 1)
    shown = []

    def show_object(obj, name=None, options=None, **kwargs):
        shown.append(obj)

    namespace = {"__name__": "__main__", "__file__": SCRIPT, "cq": cq, SHOW: show_object}
    preset = set(namespace)
    try:
        exec(code, namespace)
    except MemoryError:
        raise  # the worker reports it as memory_exceeded
    except SystemExit as err:
        if err.code not in (None, 0):
            fail("script", f"the script exited with status {err.code!r}", 1)
    except BaseException as err:  # noqa: BLE001 - the script's own error, reported to the model
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)
        fail("script", "".join(traceback.format_exception_only(type(err), err)).strip(), 1)
    shape = part_of(cq, namespace, preset, shown)
    solids = shape.Solids()
    if not solids:
        fail("result", f"the part holds no solid (a {shape.ShapeType()} only)", 1)
    shape = solids[0] if len(solids) == 1 else cq.Compound.makeCompound(solids)
    box = shape.BoundingBox()
    vertices, triangles = shape.tessellate(max(1e-4, TOLERANCE * box.DiagonalLength), ANGULAR_TOLERANCE)
    if len(triangles) > MAX_TRIANGLES:
        fail("mesh", f"the part tessellates into {len(triangles)} triangles; the limit is {MAX_TRIANGLES}", 1)
    if not triangles:
        fail("mesh", "the part tessellates into no triangles", 1)
    with open(VERTICES, "wb") as fh:
        fh.write(np.asarray([v.toTuple() for v in vertices], dtype="<f4").tobytes())
    with open(TRIANGLES, "wb") as fh:
        fh.write(np.asarray(triangles, dtype="<i4").tobytes())
    report(
        ok=True,
        volume=float(shape.Volume()),
        solids=len(solids),
        faces=len(shape.Faces()),
        bbox=[box.xlen, box.ylen, box.zlen],
    )


if __name__ == "__main__":  # the sandbox worker runs the job as __main__
    main()
