"""The program `cad.modeling` runs in the sandbox's `cad` profile (CadQuery already imported by the warm
worker): it executes the script in `part.py`, takes the shape it assigned to `result`, and writes
`cad_report.json` (what happened, B-rep properties) and the tessellated mesh (`cad_mesh.f32`,
`cad_mesh.i32`) for the grader. Its source is sent as the job's code; never imported by posttrain.

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
    namespace = {"__name__": "__main__", "__file__": SCRIPT}
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
    if RESULT_NAME not in namespace:
        fail("result", f"the script did not assign `{RESULT_NAME}`", 1)
    result = namespace[RESULT_NAME]
    if isinstance(result, cq.Workplane):
        shapes = [v for v in result.vals() if isinstance(v, cq.Shape)]
        if not shapes:
            fail("result", f"`{RESULT_NAME}` is a Workplane holding no shape (only points or wires?)", 1)
        shape = shapes[0] if len(shapes) == 1 else cq.Compound.makeCompound(shapes)
    elif isinstance(result, cq.Shape):
        shape = result
    else:
        fail("result", f"`{RESULT_NAME}` is a {type(result).__name__}, not a CadQuery Workplane or Shape", 1)
    solids = shape.Solids()
    if not solids:
        fail("result", f"`{RESULT_NAME}` holds no solid (a {shape.ShapeType()} only)", 1)
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
