"""2-D engineering drawings of `cad.modeling`'s parts: three orthographic views (third-angle: top above
front, right side to the right of front) with visible outlines, dashed hidden edges, centre lines,
hole circles, dimension lines with their numbers and hole/wall notes, rendered headless with Pillow.

A drawing is a pure function of a part's family and drawn dimensions (`Part.family`, `Part.dims`), so
its ground truth is exact: every printed dimension is one of the part's parameters (`Drawing.dims`
names each with its value and where its text is), and `Drawing.holes` is the number of round
through-holes. Nothing here runs CadQuery; the part families themselves live in `cad_modeling`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

VISIBLE, HIDDEN, CENTRE = "visible", "hidden", "centre"
VIEW_NAMES = {"top": "TOP", "front": "FRONT", "side": "RIGHT SIDE"}
FONT_PX = 11
INK = (0, 0, 0)
CENTRE_INK = (110, 110, 110)
PAPER = (255, 255, 255)
PAD_PX, GAP_PX, LABEL_H_PX = 10, 14, 17
DIM_GAP_PX = 8  # from a view's outline to its first dimension line
H_TIER_PX, V_TIER_PX = 16, 30  # spacing of stacked dimension lines below / left of a view
VIEW_W_PX, VIEW_H_PX = 300, 210  # the views' geometry is scaled to fit about this much paper
MIN_SCALE, MAX_SCALE = 0.6, 5.0  # px per mm
DESCRIPTION = (
    "an engineering drawing of a machined part: top, front and right side views with dimensions in mm"
)

# What each dimension name measures, as a question phrase ("What is the {phrase}?").
PHRASES = {
    "length": "overall length of the part along x",
    "width": "overall width of the part along y",
    "height": "overall height of the part along z",
    "diameter": "diameter of the cylinder",
    "thickness": "thickness of the part (of its legs, for a bracket)",
    "hole_diameter": "diameter of the through-holes",
    "hole_spacing_x": "distance between the hole centres along x",
    "hole_spacing_y": "distance between the hole centres along y",
    "outer_diameter": "outer diameter of the part",
    "inner_diameter": "inner diameter of the tube",
    "bore_diameter": "diameter of the central bore",
    "bolt_hole_diameter": "diameter of the bolt holes",
    "bolt_circle_diameter": "diameter of the bolt circle",
    "leg_length": "length of the horizontal leg along x",
    "leg_height": "height of the vertical leg along z",
    "window_width": "width of the window in the front wall",
    "window_height": "height of the window in the front wall",
    "wall_thickness": "thickness of the walls and floor",
    "hub_diameter": "diameter of the hub",
    "hub_height": "height of the hub above the disc",
    "disc_thickness": "thickness of the disc",
    "corner_radius": "radius of the rounded corners",
}
for _k, _word in enumerate(("bottom", "second", "third"), 1):
    PHRASES[f"section_{_k}_diameter"] = (
        f"diameter of the {_word} section of the shaft (counted from the bottom)"
    )
    PHRASES[f"section_{_k}_length"] = f"length of the {_word} section of the shaft (counted from the bottom)"


# ---- the sheet: what is drawn, in mm, per view ------------------------------------------------------


@dataclass(frozen=True)
class Seg:
    u0: float
    v0: float
    u1: float
    v1: float
    style: str = VISIBLE


@dataclass(frozen=True)
class Circle:
    u: float
    v: float
    r: float
    style: str = VISIBLE
    hole: bool = False  # a round through-hole (what "how many holes" counts)


@dataclass(frozen=True)
class Rect:
    u0: float
    v0: float
    u1: float
    v1: float
    radius: float = 0.0
    style: str = VISIBLE


@dataclass(frozen=True)
class Dim:
    """A linear dimension: `axis` "h" measures along u between u=a and u=b (extension lines from v=at_a
    and v=at_b down to a line below the view), "v" along v between v=a and v=b (from u=at_a and u=at_b
    left to a line left of the view). `prefix` "Ø" marks a diameter."""

    name: str
    axis: str
    a: float
    b: float
    at_a: float
    at_b: float
    prefix: str = ""

    @property
    def value(self) -> float:
        return abs(self.b - self.a)


@dataclass(frozen=True)
class Note:
    """A dimension given as a note in the free corner of the sheet (hole sizes, wall thickness)."""

    name: str
    value: float
    template: str  # with {v}: the value as printed


@dataclass
class View:
    shapes: list[Any] = field(default_factory=list)
    dims: list[Dim] = field(default_factory=list)
    bounds: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # u0, v0, u1, v1


@dataclass
class Sheet:
    family: str
    views: dict[str, View]
    notes: list[Note]

    @property
    def holes(self) -> int:
        return sum(1 for s in self.views["top"].shapes if isinstance(s, Circle) and s.hole)


def mm_text(v: float) -> str:
    """A size in mm as drawings, briefs and answers print it: 6, 6.5 (no trailing zeros)."""
    return f"{v:g}"


def _cross(u: float, v: float, r: float) -> list[Seg]:
    """A circle's centre mark: two centre lines across it."""
    return [Seg(u - r, v, u + r, v, CENTRE), Seg(u, v - r, u, v + r, CENTRE)]


def _holes_through(
    holes: list[tuple[float, float, float]], z0: float, z1: float
) -> tuple[list[Seg], list[Seg]]:
    """Hidden edges and centre lines of vertical holes (u, w, r) in the front view (u = x) and the side
    view (u = y); holes on one line of sight are drawn once."""
    front: dict[float, Seg] = {}
    side: dict[float, Seg] = {}
    out_f, out_s = [], []
    for x, y, r in holes:
        for store, out, c in ((front, out_f, x), (side, out_s, y)):
            key = round(c, 6)
            if key in store:
                continue
            store[key] = Seg(c, z0, c, z1, CENTRE)
            out += [Seg(c - r, z0, c - r, z1, HIDDEN), Seg(c + r, z0, c + r, z1, HIDDEN), store[key]]
    return out_f, out_s


def _sheet(family: str, top: View, front: View, side: View, notes: list[Note] | None = None) -> Sheet:
    for view in (top, front, side):
        us, vs = [], []
        for s in view.shapes:
            if isinstance(s, Circle):
                us += [s.u - s.r, s.u + s.r]
                vs += [s.v - s.r, s.v + s.r]
            else:
                us += [s.u0, s.u1]
                vs += [s.v0, s.v1]
        view.bounds = (min(us), min(vs), max(us), max(vs))
    return Sheet(family, {"top": top, "front": front, "side": side}, notes or [])


def _box(x: float, y: float, z: float) -> Sheet:
    return _sheet(
        "box",
        View([Rect(-x / 2, -y / 2, x / 2, y / 2)]),
        View(
            [Rect(-x / 2, 0, x / 2, z)],
            [Dim("length", "h", -x / 2, x / 2, 0, 0), Dim("height", "v", 0, z, -x / 2, -x / 2)],
        ),
        View([Rect(-y / 2, 0, y / 2, z)], [Dim("width", "h", -y / 2, y / 2, 0, 0)]),
    )


def _cylinder(d: float, h: float) -> Sheet:
    r = d / 2
    elevation = [Rect(-r, 0, r, h), Seg(0, 0, 0, h, CENTRE)]
    return _sheet(
        "cylinder",
        View([Circle(0, 0, r), *_cross(0, 0, r)]),
        View(list(elevation), [Dim("diameter", "h", -r, r, 0, 0, "Ø"), Dim("height", "v", 0, h, -r, -r)]),
        View(list(elevation)),
    )


def _plate_with_holes(length: float, width: float, t: float, d: float, points: Any) -> Sheet:
    holes = [(float(px), float(py), d / 2) for px, py in points]
    hf, hs = _holes_through(holes, 0, t)
    top = View([Rect(-length / 2, -width / 2, length / 2, width / 2)])
    for px, py, r in holes:
        top.shapes += [Circle(px, py, r, hole=True), *_cross(px, py, r)]
    ax = max(px for px, _, _ in holes)
    low = min(py for _, py, _ in holes)
    top.dims += [
        Dim("length", "h", -length / 2, length / 2, -width / 2, -width / 2),
        Dim("width", "v", -width / 2, width / 2, -length / 2, -length / 2),
        Dim("hole_spacing_x", "h", -ax, ax, low, low),
    ]
    ay = max(py for _, py, _ in holes)
    if ay > 0:
        top.dims.append(Dim("hole_spacing_y", "v", -ay, ay, -ax, -ax))
    return _sheet(
        "plate_with_holes",
        top,
        View(
            [Rect(-length / 2, 0, length / 2, t), *hf],
            [Dim("thickness", "v", 0, t, -length / 2, -length / 2)],
        ),
        View([Rect(-width / 2, 0, width / 2, t), *hs]),
        [Note("hole_diameter", d, "HOLES Ø{v} THRU")],
    )


def _tube(od: float, inner: float, h: float) -> Sheet:
    r, ri = od / 2, inner / 2

    def elevation() -> list[Any]:
        return [
            Rect(-r, 0, r, h),
            Seg(-ri, 0, -ri, h, HIDDEN),
            Seg(ri, 0, ri, h, HIDDEN),
            Seg(0, 0, 0, h, CENTRE),
        ]

    return _sheet(
        "tube",
        View([Circle(0, 0, r), Circle(0, 0, ri, hole=True), *_cross(0, 0, r)]),
        View(elevation(), [Dim("outer_diameter", "h", -r, r, 0, 0, "Ø"), Dim("height", "v", 0, h, -r, -r)]),
        View(elevation(), [Dim("inner_diameter", "h", -ri, ri, 0, 0, "Ø")]),
    )


def _block_with_bore(x: float, y: float, z: float, d: float) -> Sheet:
    hf, hs = _holes_through([(0.0, 0.0, d / 2)], 0, z)
    return _sheet(
        "block_with_bore",
        View([Rect(-x / 2, -y / 2, x / 2, y / 2), Circle(0, 0, d / 2, hole=True), *_cross(0, 0, d / 2)]),
        View(
            [Rect(-x / 2, 0, x / 2, z), *hf],
            [
                Dim("length", "h", -x / 2, x / 2, 0, 0),
                Dim("bore_diameter", "h", -d / 2, d / 2, 0, 0, "Ø"),
                Dim("height", "v", 0, z, -x / 2, -x / 2),
            ],
        ),
        View([Rect(-y / 2, 0, y / 2, z), *hs], [Dim("width", "h", -y / 2, y / 2, 0, 0)]),
    )


def _l_bracket(a: float, b: float, t: float, w: float) -> Sheet:
    profile = [(0, 0), (a, 0), (a, t), (t, t), (t, b), (0, b), (0, 0)]
    outline = [Seg(p[0], p[1], q[0], q[1]) for p, q in zip(profile, profile[1:], strict=False)]
    return _sheet(
        "l_bracket",
        View([Rect(0, -w / 2, a, w / 2), Seg(t, -w / 2, t, w / 2)]),
        View(outline, [Dim("leg_length", "h", 0, a, 0, 0), Dim("leg_height", "v", 0, b, 0, 0)]),
        View([Rect(-w / 2, 0, w / 2, b), Seg(-w / 2, t, w / 2, t)], [Dim("width", "h", -w / 2, w / 2, 0, 0)]),
        [Note("thickness", t, "BOTH LEGS {v} THICK")],
    )


def _flange(d_out: float, bore: float, hole: float, bolt: float, n: int, t: float) -> Sheet:
    r, rb = d_out / 2, bolt / 2
    bolts = [
        (rb * math.cos(2 * math.pi * i / n), rb * math.sin(2 * math.pi * i / n), hole / 2) for i in range(n)
    ]
    hf, hs = _holes_through([(0.0, 0.0, bore / 2), *bolts], 0, t)
    top = View(
        [Circle(0, 0, r), Circle(0, 0, bore / 2, hole=True), Circle(0, 0, rb, CENTRE), *_cross(0, 0, r)]
    )
    for x, y, rh in bolts:
        top.shapes += [Circle(x, y, rh, hole=True), *_cross(x, y, rh * 1.4)]
    return _sheet(
        "flange",
        top,
        View(
            [Rect(-r, 0, r, t), *hf],
            [Dim("outer_diameter", "h", -r, r, 0, 0, "Ø"), Dim("thickness", "v", 0, t, -r, -r)],
        ),
        View([Rect(-r, 0, r, t), *hs], [Dim("bore_diameter", "h", -bore / 2, bore / 2, 0, 0, "Ø")]),
        [
            Note("bolt_hole_diameter", hole, "BOLT HOLES Ø{v} THRU,"),
            Note("bolt_circle_diameter", bolt, "EQUALLY SPACED ON Ø{v}"),
        ],
    )


def _stepped_shaft(diameters: Any, lengths: Any) -> Sheet:
    top, front = View(), View()
    z = 0.0
    for k, (d, length) in enumerate(zip(diameters, lengths, strict=True), 1):
        top.shapes.append(Circle(0, 0, d / 2))
        top.dims.append(Dim(f"section_{k}_diameter", "h", -d / 2, d / 2, 0, 0, "Ø"))
        front.shapes.append(Rect(-d / 2, z, d / 2, z + length))
        front.dims.append(Dim(f"section_{k}_length", "v", z, z + length, -d / 2, -d / 2))
        z += length
    top.shapes += _cross(0, 0, diameters[0] / 2)
    front.shapes.append(Seg(0, 0, 0, z, CENTRE))
    return _sheet("stepped_shaft", top, front, View(list(front.shapes)))


def _enclosure(x: float, y: float, z: float, t: float, a: float, b: float) -> Sheet:
    w0, w1 = z / 2 - b / 2, z / 2 + b / 2  # the window's bottom and top
    xi, yi = x / 2 - t, y / 2 - t
    top = View(
        [
            Rect(-x / 2, -y / 2, x / 2, y / 2),
            Rect(-xi, -yi, xi, yi),
            Seg(-a / 2, -y / 2, -a / 2, -yi, HIDDEN),
            Seg(a / 2, -y / 2, a / 2, -yi, HIDDEN),
        ]
    )
    front = View(
        [
            Rect(-x / 2, 0, x / 2, z),
            Rect(-a / 2, w0, a / 2, w1),
            Seg(-xi, t, -xi, z, HIDDEN),
            Seg(xi, t, xi, z, HIDDEN),
            Seg(-xi, t, xi, t, HIDDEN),
        ],
        [
            Dim("length", "h", -x / 2, x / 2, 0, 0),
            Dim("window_width", "h", -a / 2, a / 2, w0, w0),
            Dim("height", "v", 0, z, -x / 2, -x / 2),
            Dim("window_height", "v", w0, w1, -a / 2, -a / 2),
        ],
    )
    side = View(
        [
            Rect(-y / 2, 0, y / 2, z),
            Seg(-yi, t, -yi, z, HIDDEN),
            Seg(yi, t, yi, z, HIDDEN),
            Seg(-yi, t, yi, t, HIDDEN),
            Seg(-y / 2, w0, -yi, w0, HIDDEN),
            Seg(-y / 2, w1, -yi, w1, HIDDEN),
        ],
        [Dim("width", "h", -y / 2, y / 2, 0, 0)],
    )
    return _sheet("enclosure", top, front, side, [Note("wall_thickness", t, "WALLS AND FLOOR {v} THICK")])


def _gear_blank(d_out: float, hub: float, bore: float, t: float, th: float) -> Sheet:
    r, rh, rb = d_out / 2, hub / 2, bore / 2

    def elevation() -> list[Any]:
        return [
            Rect(-r, 0, r, t),
            Rect(-rh, t, rh, t + th),
            Seg(-rb, 0, -rb, t + th, HIDDEN),
            Seg(rb, 0, rb, t + th, HIDDEN),
            Seg(0, 0, 0, t + th, CENTRE),
        ]

    return _sheet(
        "gear_blank",
        View(
            [Circle(0, 0, r), Circle(0, 0, rh), Circle(0, 0, rb, hole=True), *_cross(0, 0, r)],
            [Dim("hub_diameter", "h", -rh, rh, 0, 0, "Ø")],
        ),
        View(
            elevation(),
            [
                Dim("outer_diameter", "h", -r, r, 0, 0, "Ø"),
                Dim("disc_thickness", "v", 0, t, -r, -r),
                Dim("hub_height", "v", t, t + th, -rh, -rh),
            ],
        ),
        View(elevation(), [Dim("bore_diameter", "h", -rb, rb, 0, 0, "Ø")]),
    )


def _rounded_plate(x: float, y: float, t: float, r: float, d: float) -> Sheet:
    ax, ay = x // 2 - r - d, y // 2 - r - d
    holes = [(sx * ax, sy * ay, d / 2) for sy in (-1, 1) for sx in (-1, 1)]
    hf, hs = _holes_through(holes, 0, t)
    top = View(
        [Rect(-x / 2, -y / 2, x / 2, y / 2, radius=r)],
        [
            Dim("length", "h", -x / 2, x / 2, -y / 2, -y / 2),
            Dim("hole_spacing_x", "h", -ax, ax, -ay, -ay),
            Dim("width", "v", -y / 2, y / 2, -x / 2, -x / 2),
            Dim("hole_spacing_y", "v", -ay, ay, -ax, -ax),
        ],
    )
    for hx, hy, hr in holes:
        top.shapes += [Circle(hx, hy, hr, hole=True), *_cross(hx, hy, hr)]
    return _sheet(
        "rounded_plate",
        top,
        View([Rect(-x / 2, 0, x / 2, t), *hf], [Dim("thickness", "v", 0, t, -x / 2, -x / 2)]),
        View([Rect(-y / 2, 0, y / 2, t), *hs]),
        [Note("hole_diameter", d, "HOLES Ø{v} THRU"), Note("corner_radius", r, "CORNERS R{v}")],
    )


SHEETS = {
    "box": _box,
    "cylinder": _cylinder,
    "plate_with_holes": _plate_with_holes,
    "tube": _tube,
    "block_with_bore": _block_with_bore,
    "l_bracket": _l_bracket,
    "flange": _flange,
    "stepped_shaft": _stepped_shaft,
    "enclosure": _enclosure,
    "gear_blank": _gear_blank,
    "rounded_plate": _rounded_plate,
}


def sheet_of(family: str, dims: tuple[Any, ...]) -> Sheet:
    """The drawing's content for a `cad.modeling` part (its family and drawn dimensions)."""
    if family not in SHEETS:
        raise ValueError(f"no drawing for part family {family!r} (known: {', '.join(SHEETS)})")
    return SHEETS[family](*dims)


# ---- rendering --------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def drawing_font() -> Any:
    """DejaVu Sans (shipped inside matplotlib, a base dependency), which has the Ø sign."""
    import os

    import matplotlib
    from PIL import ImageFont

    return ImageFont.truetype(os.path.join(matplotlib.get_data_path(), "fonts/ttf/DejaVuSans.ttf"), FONT_PX)


def draw_label(draw: Any, xy: tuple[int, int], text: str) -> tuple[int, int, int, int]:
    """Print `text` centred on `xy` (the renderer's only text call, so a test can redraw a label alone);
    returns its pixel box."""
    draw.text(xy, text, font=drawing_font(), fill=INK, anchor="mm")
    return tuple(draw.textbbox(xy, text, font=drawing_font(), anchor="mm"))  # type: ignore[return-value]


@dataclass(frozen=True)
class Printed:
    """One dimension as printed: its name, value (mm), text, and the pixel box and centre of the text."""

    name: str
    value: float
    text: str
    xy: tuple[int, int]
    box: tuple[int, int, int, int]


@dataclass
class Drawing:
    """A rendered drawing and its exact ground truth."""

    pixels: np.ndarray  # HxWx3 uint8
    dims: list[Printed]
    holes: int
    hole_circles: list[tuple[float, float, float]]  # (x, y, r) in pixels, top view
    views: dict[str, tuple[int, int, int, int]]  # each view's outline box in pixels

    def dim(self, name: str) -> Printed:
        for d in self.dims:
            if d.name == name:
                return d
        raise KeyError(name)


def _text_size(text: str) -> tuple[int, int]:
    left, top, right, bottom = drawing_font().getbbox(text, anchor="mm")
    return int(right - left), int(bottom - top)


def _dim_text(d: Dim) -> str:
    return d.prefix + mm_text(d.value)


def _tiers(view: View, axis: str, scale: float) -> list[tuple[Dim, int]]:
    """Each dimension of `axis` with its tier (0 nearest the view): shortest first, each on the lowest
    tier where its extent (text included) overlaps no other's."""
    dims = sorted((d for d in view.dims if d.axis == axis), key=lambda d: d.value)
    placed: list[tuple[Dim, int, float, float]] = []
    out = []
    for d in dims:
        lo, hi = min(d.a, d.b) * scale, max(d.a, d.b) * scale
        tw, th = _text_size(_dim_text(d))
        need = tw if axis == "h" else th
        if hi - lo < need + 12:  # the text goes past the far end
            hi += need + 6
        tier = 0
        while any(t == tier and lo < top + 6 and low < hi + 6 for _, t, low, top in placed):
            tier += 1
        placed.append((d, tier, lo, hi))
        out.append((d, tier))
    return out


def _dashes(
    draw: Any,
    p0: tuple[float, float],
    p1: tuple[float, float],
    pattern: tuple[int, ...],
    fill: Any,
    width: int,
) -> None:
    (x0, y0), (x1, y1) = p0, p1
    length = math.hypot(x1 - x0, y1 - y0)
    if length < 1e-9:
        return
    ux, uy = (x1 - x0) / length, (y1 - y0) / length
    pos, k = 0.0, 0
    while pos < length:
        step = pattern[k % len(pattern)]
        if k % 2 == 0:
            end = min(length, pos + step)
            draw.line(
                [(x0 + ux * pos, y0 + uy * pos), (x0 + ux * end, y0 + uy * end)], fill=fill, width=width
            )
        pos += step
        k += 1


def _arrow(draw: Any, tip: tuple[float, float], direction: tuple[float, float]) -> None:
    """A filled arrowhead at `tip` pointing along `direction` (a unit vector)."""
    dx, dy = direction
    back = (tip[0] - 6 * dx, tip[1] - 6 * dy)
    draw.polygon(
        [tip, (back[0] - 2.5 * dy, back[1] + 2.5 * dx), (back[0] + 2.5 * dy, back[1] - 2.5 * dx)], fill=INK
    )


def render(sheet: Sheet) -> Drawing:
    """Lay out and draw the three views with their dimensions and notes."""
    from PIL import Image, ImageDraw

    views = sheet.views
    span = {k: (v.bounds[2] - v.bounds[0], v.bounds[3] - v.bounds[1]) for k, v in views.items()}
    scale = min(
        VIEW_W_PX / (span["front"][0] + span["side"][0]),
        VIEW_H_PX / (span["top"][1] + span["front"][1]),
    )
    scale = max(MIN_SCALE, min(MAX_SCALE, scale))
    tiers = {k: {ax: _tiers(v, ax, scale) for ax in ("h", "v")} for k, v in views.items()}

    def n_tiers(k: str, ax: str) -> int:
        return 1 + max((t for _, t in tiers[k][ax]), default=-1)

    def left_m(k: str) -> int:
        return DIM_GAP_PX + n_tiers(k, "v") * V_TIER_PX if n_tiers(k, "v") else 4

    def bottom_m(k: str) -> int:
        return DIM_GAP_PX + n_tiers(k, "h") * H_TIER_PX if n_tiers(k, "h") else 4

    notes = [n.template.format(v=mm_text(n.value)) for n in sheet.notes]
    notes_w = max((_text_size(t)[0] for t in notes), default=0) + 8
    notes_h = len(notes) * (FONT_PX + 5)
    w_px = {k: int(math.ceil(s[0] * scale)) for k, s in span.items()}
    h_px = {k: int(math.ceil(s[1] * scale)) for k, s in span.items()}
    col0 = PAD_PX + max(left_m("top"), left_m("front"))
    col1 = col0 + w_px["front"] + GAP_PX
    side_x = col1 + left_m("side")
    top_y = PAD_PX + LABEL_H_PX
    row0_h = max(h_px["top"] + bottom_m("top"), notes_h + 8)
    front_y = top_y + row0_h + GAP_PX + LABEL_H_PX
    width = max(side_x + w_px["side"], col1 + notes_w) + PAD_PX + 30  # room for text past a short dimension
    height = front_y + max(h_px["front"], h_px["side"]) + max(bottom_m("front"), bottom_m("side")) + PAD_PX
    origin = {"top": (col0, top_y), "front": (col0, front_y), "side": (side_x, front_y)}

    image = Image.new("RGB", (width, height), PAPER)
    draw = ImageDraw.Draw(image)
    labels: list[tuple[tuple[int, int], str, str, float]] = []  # (xy, text, name, value), drawn last

    def to_px(k: str, u: float, v: float) -> tuple[float, float]:
        u0, _, _, v1 = views[k].bounds
        ox, oy = origin[k]
        return ox + (u - u0) * scale, oy + (v1 - v) * scale

    hole_circles = []
    for k, view in views.items():
        ordered = sorted(view.shapes, key=lambda s: s.style == VISIBLE)  # visible lines over the rest
        for s in ordered:
            fill = CENTRE_INK if s.style == CENTRE else INK
            if isinstance(s, Circle):
                cx, cy = to_px(k, s.u, s.v)
                rp = s.r * scale
                if s.hole and k == "top":
                    hole_circles.append((cx, cy, rp))
                if s.style == VISIBLE:
                    draw.ellipse([cx - rp, cy - rp, cx + rp, cy + rp], outline=INK, width=1)
                else:  # a centre-line circle: dashed arcs of about 10 px
                    steps = max(8, int(2 * math.pi * rp / 14))
                    for i in range(steps):
                        a0 = 360 * i / steps
                        draw.arc([cx - rp, cy - rp, cx + rp, cy + rp], a0, a0 + 360 / steps * 0.65, fill=fill)
            elif isinstance(s, Rect):
                x0, y0 = to_px(k, s.u0, s.v1)
                x1, y1 = to_px(k, s.u1, s.v0)
                if s.radius > 0:
                    draw.rounded_rectangle([x0, y0, x1, y1], radius=s.radius * scale, outline=INK, width=2)
                else:
                    draw.rectangle([x0, y0, x1, y1], outline=INK, width=2)
            else:
                p0, p1 = to_px(k, s.u0, s.v0), to_px(k, s.u1, s.v1)
                if s.style == VISIBLE:
                    draw.line([p0, p1], fill=INK, width=2)
                elif s.style == HIDDEN:
                    _dashes(draw, p0, p1, (4, 3), INK, 1)
                else:  # centre lines run a little past what they mark
                    length = max(1e-9, math.hypot(p1[0] - p0[0], p1[1] - p0[1]))
                    ex, ey = 4 * (p1[0] - p0[0]) / length, 4 * (p1[1] - p0[1]) / length
                    _dashes(draw, (p0[0] - ex, p0[1] - ey), (p1[0] + ex, p1[1] + ey), (9, 2, 2, 2), fill, 1)
        ox, oy = origin[k]
        draw_label(draw, (ox + w_px[k] // 2, oy - LABEL_H_PX // 2 - 1), VIEW_NAMES[k])
        for d, tier in tiers[k]["h"]:
            y = oy + h_px[k] + DIM_GAP_PX + tier * H_TIER_PX + 4
            xa, ya = to_px(k, d.a, d.at_a)
            xb, yb = to_px(k, d.b, d.at_b)
            xa, xb = sorted((xa, xb))
            for xe, ye in ((xa, ya), (xb, yb)):
                draw.line([(xe, ye + 3), (xe, y + 4)], fill=INK, width=1)
            draw.line([(xa, y), (xb, y)], fill=INK, width=1)
            text = _dim_text(d)
            tw, _ = _text_size(text)
            if xb - xa >= tw + 12:
                _arrow(draw, (xa, y), (-1, 0))
                _arrow(draw, (xb, y), (1, 0))
                xy = (int(round((xa + xb) / 2)), int(y))
            else:
                _arrow(draw, (xa, y), (1, 0))
                _arrow(draw, (xb, y), (-1, 0))
                xy = (int(round(xb + 5 + tw / 2)), int(y))
            labels.append((xy, text, d.name, d.value))
        for d, tier in tiers[k]["v"]:
            x = ox - DIM_GAP_PX - tier * V_TIER_PX - V_TIER_PX // 2 + 4
            xa, ya = to_px(k, d.at_a, d.a)
            xb, yb = to_px(k, d.at_b, d.b)
            (ya, xa), (yb, xb) = sorted(((ya, xa), (yb, xb)))
            for xe, ye in ((xa, ya), (xb, yb)):
                draw.line([(xe - 3, ye), (x - 4, ye)], fill=INK, width=1)
            draw.line([(x, ya), (x, yb)], fill=INK, width=1)
            text = _dim_text(d)
            _, th = _text_size(text)
            if yb - ya >= th + 12:
                _arrow(draw, (x, ya), (0, -1))
                _arrow(draw, (x, yb), (0, 1))
                xy = (int(x), int(round((ya + yb) / 2)))
            else:
                _arrow(draw, (x, ya), (0, 1))
                _arrow(draw, (x, yb), (0, -1))
                xy = (int(x), int(round(ya - 5 - th / 2)))
            labels.append((xy, text, d.name, d.value))
    for i, (note, text) in enumerate(zip(sheet.notes, notes, strict=True)):
        tw, _ = _text_size(text)
        xy = (col1 + 4 + tw // 2, top_y + 4 + i * (FONT_PX + 5) + FONT_PX // 2)
        labels.append((xy, text, note.name, note.value))

    printed = []
    for xy, text, _, _ in labels:  # text over a paper box, so each label reads clean
        x0, y0, x1, y1 = draw.textbbox(xy, text, font=drawing_font(), anchor="mm")
        draw.rectangle([x0 - 2, y0 - 1, x1 + 1, y1 + 1], fill=PAPER)
    for xy, text, name, value in labels:
        printed.append(Printed(name, value, text, xy, draw_label(draw, xy, text)))
    boxes = {k: (origin[k][0], origin[k][1], origin[k][0] + w_px[k], origin[k][1] + h_px[k]) for k in views}
    return Drawing(np.asarray(image), printed, sheet.holes, hole_circles, boxes)


def render_part(family: str, dims: tuple[Any, ...]) -> Drawing:
    """The drawing of a `cad.modeling` part."""
    return render(sheet_of(family, dims))
