"""The engineering drawings of cad.modeling's parts: every printed number is the parameter it names and
is what the pixels show (each label redrawn alone matches the image), hole circles are drawn where the
holes are, the views span the solid CadQuery builds from the reference script, and its round
through-holes are the drawing's; and cad.modeling with the drawing as the brief (grading unchanged)."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
from PIL import Image, ImageDraw

from posttrain.envs import get_domain
from posttrain.envs.domains import cad_modeling as cad
from posttrain.envs.domains.cad_drawing import (
    DESCRIPTION,
    PAPER,
    draw_label,
    render_part,
    sheet_of,
)
from posttrain.envs.scripted import check_reference, run_episode
from posttrain.types import ImagePart

from .conftest import run

needs_cad = pytest.mark.skipif(not cad.cadquery_available(), reason=cad.INSTALL_HINT)
ALL_FAMILIES = [f for level in sorted(cad.FAMILIES) for f in cad.FAMILIES[level]]
DRAWS = 6  # parts per family


def _parts():
    for family in ALL_FAMILIES:
        for seed in range(DRAWS):
            yield family(random.Random(1000 + seed))


def holes_from_parameters(part: cad.Part) -> int:
    """Round through-holes, counted from the generator's draw (the bore of a tube or gear blank is one)."""
    dims = part.dims
    return {
        "plate_with_holes": lambda: len(dims[4]),
        "block_with_bore": lambda: 1,
        "tube": lambda: 1,
        "flange": lambda: dims[4] + 1,
        "gear_blank": lambda: 1,
        "rounded_plate": lambda: 4,
    }.get(part.family, lambda: 0)()


def test_box_drawing_prints_its_three_sizes_and_nothing_else():
    d = render_part("box", (38, 77, 12))
    assert sorted((p.name, p.text, p.value) for p in d.dims) == [
        ("height", "12", 12),
        ("length", "38", 38),
        ("width", "77", 77),
    ]
    assert d.holes == 0 and d.hole_circles == []
    flange = render_part("flange", (80, 26, 5, 52, 6, 14))
    assert {p.name: p.text for p in flange.dims} == {
        "outer_diameter": "Ø80",
        "thickness": "14",
        "bore_diameter": "Ø26",
        "bolt_hole_diameter": "BOLT HOLES Ø5 THRU,",
        "bolt_circle_diameter": "EQUALLY SPACED ON Ø52",
    }
    assert flange.holes == 7 and len(flange.hole_circles) == 7


def test_every_printed_label_is_in_the_pixels_and_labels_never_collide():
    for part in _parts():
        d = render_part(part.family, part.dims)
        h, w, _ = d.pixels.shape
        alone = Image.new("RGB", (w, h), PAPER)
        draw = ImageDraw.Draw(alone)
        for p in d.dims:
            assert draw_label(draw, p.xy, p.text) == p.box
        ref = np.asarray(alone)
        for i, p in enumerate(d.dims):
            x0, y0, x1, y1 = p.box
            assert 0 <= x0 and 0 <= y0 and x1 <= w and y1 <= h, (part, p)
            assert np.array_equal(d.pixels[y0:y1, x0:x1], ref[y0:y1, x0:x1]), (part, p.name)
            assert (d.pixels[y0:y1, x0:x1] < 128).any()
            for q in d.dims[i + 1 :]:
                overlap = not (x1 <= q.box[0] or q.box[2] <= x0 or y1 <= q.box[1] or q.box[3] <= y0)
                assert not overlap, (part, p.name, q.name)


def test_printed_numbers_are_the_parameters_they_name():
    for part in _parts():
        d = render_part(part.family, part.dims)
        got = {p.name: p.value for p in d.dims}
        for p in d.dims:
            assert f"{p.value:g}" in p.text.replace("Ø", " ").replace("R", " ").split()
        fam, v = part.family, part.dims
        if fam == "box":
            assert got == {"length": v[0], "width": v[1], "height": v[2]}
        elif fam == "cylinder":
            assert got == {"diameter": v[0], "height": v[1]}
        elif fam == "flange":
            d_out, bore, hole, bolt, _, t = v
            assert got == {
                "outer_diameter": d_out,
                "bore_diameter": bore,
                "bolt_hole_diameter": hole,
                "bolt_circle_diameter": bolt,
                "thickness": t,
            }
        elif fam == "stepped_shaft":
            for k, (dia, length) in enumerate(zip(*v, strict=True), 1):
                assert got[f"section_{k}_diameter"] == dia and got[f"section_{k}_length"] == length
        elif fam == "plate_with_holes":
            length, width, t, dia, points = v
            xs = sorted({x for x, _ in points})
            assert got["length"] == length and got["width"] == width and got["thickness"] == t
            assert got["hole_diameter"] == dia and got["hole_spacing_x"] == xs[-1] - xs[0]
        elif fam == "gear_blank":
            assert got == dict(
                zip(
                    ("outer_diameter", "hub_diameter", "bore_diameter", "disc_thickness", "hub_height"),
                    v,
                    strict=True,
                )
            )


def test_hole_circles_are_drawn_where_the_holes_are_and_counted_from_the_parameters():
    for part in _parts():
        d = render_part(part.family, part.dims)
        assert d.holes == len(d.hole_circles) == holes_from_parameters(part), part
        dark = (d.pixels < 128).all(axis=-1)
        for cx, cy, r in d.hole_circles:
            inked = 0
            for k in range(48):
                a = 2 * math.pi * k / 48
                x, y = int(round(cx + r * math.cos(a))), int(round(cy + r * math.sin(a)))
                inked += bool(dark[y - 1 : y + 2, x - 1 : x + 2].any())
            assert inked >= 46, (part, (cx, cy, r), inked)


def test_drawings_are_deterministic_and_differ_when_the_part_differs():
    a = render_part("plate_with_holes", (70, 67, 5, 8, ((-27, 0), (27, 0))))
    b = render_part("plate_with_holes", (70, 67, 5, 8, ((-27, 0), (27, 0))))
    c = render_part("plate_with_holes", (70, 67, 5, 8, ((-27, -20), (27, -20), (-27, 20), (27, 20))))
    assert (
        np.array_equal(a.pixels, b.pixels)
        and a.pixels.shape != c.pixels.shape
        or not np.array_equal(a.pixels, c.pixels)
    )
    assert (a.holes, c.holes) == (2, 4)
    with pytest.raises(ValueError, match="no drawing for part family 'gear'"):
        sheet_of("gear", (1, 2))


def _solid(code: str):
    scope: dict = {}
    exec(compile(code, "<reference>", "exec"), scope)  # noqa: S102 - our own reference scripts
    return scope["result"].val()


@needs_cad
def test_views_span_the_built_solid_and_its_round_through_holes_are_the_drawings():
    for family in ALL_FAMILIES:
        for seed in range(2):
            part = family(random.Random(2000 + seed))
            solid = _solid(part.code)
            bb = solid.BoundingBox()
            sheet = sheet_of(part.family, part.dims)

            def span(view: str, axis: int, sheet=sheet) -> float:
                b = sheet.views[view].bounds
                return b[2 + axis] - b[axis]

            assert span("front", 0) == pytest.approx(bb.xlen, abs=1e-3), part
            assert span("side", 0) == pytest.approx(bb.ylen, abs=1e-3), part
            assert span("front", 1) == pytest.approx(bb.zlen, abs=1e-3), part
            assert span("top", 1) == pytest.approx(bb.ylen, abs=1e-3), part
            top = max(solid.Faces(), key=lambda f: f.Center().z if f.normalAt().z > 0.99 else -1e9)
            circles = [
                w.Edges()[0].radius() * 2
                for w in top.innerWires()
                if len(w.Edges()) == 1 and w.Edges()[0].geomType() == "CIRCLE"
            ]
            d = render_part(part.family, part.dims)
            assert len(circles) == d.holes, part
            printed = {
                p.value
                for p in d.dims
                if p.name in ("hole_diameter", "bolt_hole_diameter", "bore_diameter", "inner_diameter")
            }
            assert {round(c, 3) for c in circles} == printed, part


# ---- cad.modeling with the drawing as the brief ---------------------------------------------------------


def _images(task) -> list[ImagePart]:
    return task.prompt[0].images


def _pixels(img: ImagePart) -> np.ndarray:
    with Image.open(io.BytesIO(img.png)) as im:
        return np.asarray(im.convert("RGB"))


@needs_cad
def test_the_drawing_brief_puts_the_targets_drawing_in_the_first_observation_with_the_text_for_text_models():
    text, drawing, both = (get_domain("cad.modeling", brief=b) for b in ("text", "drawing", "both"))
    for level in (1, 2, 3):
        t, d = text.task("train", level, 0), drawing.task("train", level, 0)
        assert t.meta["content_key"] == d.meta["content_key"] and d.meta["brief"] == "drawing"
        assert isinstance(t.prompt[0].content, str) and not _images(t)
        (img,) = _images(d)
        description = d.meta["description"]
        assert np.array_equal(_pixels(img), render_part(d.meta["family"], tuple(d.meta["dims"])).pixels)
        assert img.description == description  # what a text-only model reads in the image's place
        assert description not in " ".join(
            p.text for p in d.prompt[0].content if not isinstance(p, ImagePart)
        )
        assert d.prompt[0].text.count(description) == 1
        b = both.task("train", level, 0)
        (bimg,) = _images(b)
        assert bimg.description == DESCRIPTION and b.prompt[0].text.count(description) == 1
    # level 0: an earlier exchange, the example's drawing then its script, then the part's drawing
    zero = drawing.task("train", 0, 0)
    ask_example, answer, ask = zero.prompt
    assert [m.role for m in zero.prompt] == ["user", "assistant", "user"]
    brief, code = cad.EXAMPLES[zero.meta["family"]]
    (example,), (task_img,) = ask_example.images, ask.images
    assert example.description == brief and task_img.description == zero.meta["description"]
    assert answer.content == code


@needs_cad
def test_with_the_drawing_brief_the_grader_is_unchanged(sandbox):
    drawing = get_domain("cad.modeling", brief="drawing")
    for level in (1, 3):
        task = drawing.task("heldout", level, 1)
        assert (
            task.meta["reference_code"]
            == get_domain("cad.modeling").task("heldout", level, 1).meta["reference_code"]
        )
        assert run(check_reference(drawing, task, sandbox)).reward == 1.0
        tiny = "```python\nimport cadquery as cq\nresult = cq.Workplane('XY').box(1, 1, 1)\n```"
        wrong = run(run_episode(drawing.make_env(sandbox), task, [tiny] * 3))
        assert wrong.rewards["success"] == 0.0 and wrong.rewards["valid"] == 1.0


def test_an_unknown_brief_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"brief must be one of text, drawing, both .* got 'image'"):
        get_domain("cad.modeling", brief="image")
    with pytest.raises(ValueError, match="bad options for domain 'cad.modeling'"):
        get_domain("cad.modeling", brief_mode="drawing")
