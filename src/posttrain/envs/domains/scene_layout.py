"""`scene.layout`: game-engine-style scene configuration. The model writes a JSON scene (objects with
type, position, rotation, scale, parent) that must satisfy a brief with constraints; a checker scores
each constraint, and a top-down render of the scene is the visual feedback.

Coordinates: metres, z up. The room spans x in [0, width] (left to right as seen from the camera at
y = 0), y in [0, depth] (front to back) and z in [0, height]. An object's `position` is the centre of its
footprint at its bottom face, in world coordinates; `rotation` is its yaw in degrees, one of 0, 90,
180, 270, counter-clockwise seen from above; at yaw 0 it faces +y (away from the camera). Its size is
the catalogue size of its type times `scale`, along its own axes (a yaw of 90 or 270 swaps the
footprint's x and y). `parent` names the object it rests on or in (null for the floor).

Constraints (each 0/1): `named` (an id exists with the brief's type), `count` (exactly n of a type),
`left_of`/`right_of`/`in_front_of`/`behind` (footprints strictly apart along x or y), `on_top_of` (the
parent is set, the bottom sits on the parent's top within 1 cm, the footprint inside the parent's),
`inside` (a lamp, box or tv with a shelf or crate as parent, its 3-D box inside the parent's), `facing` (the front within 45 degrees of
the direction to the other's centre), `near`/`apart` (centre distance in the floor plane at most / at
least d), `no_overlap` (no two boxes intersect, except a child actually resting on or in its parent),
`within_bounds` (every box inside the room) and `supported` (every object on the floor or on/in its
parent).

Reward = the fraction of constraints satisfied, 0 for a reply that is not a valid scene (invalid JSON,
schema violations, non-finite numbers, duplicate or dangling ids, parent cycles: the error is the
feedback); `success` is strict: every constraint satisfied; `format` = a valid scene. Levels: 0 = one
named object (a worked example in the prompt), 1 = two objects and one relation, 2 = three or four
objects, a count and an on-top-of, 3 = five to seven objects, four relations. Option `turns` (default
1): with more, each failed submission is answered with the failed constraints and a render, and the
last submission is scored. Residual risk: none from code (no code runs); the reference scene is one
layout among many that satisfy the brief.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from posttrain.envs.base import Domain, Environment, Observation, StepResult
from posttrain.envs.extract import json_object_or_error
from posttrain.envs.registry import register_env
from posttrain.types import ImagePart, Message, Task, TextPart

MAX_REPLY_CHARS = 100_000
MAX_OBJECTS = 64
HEIGHT = 3.0
TOL = 1e-6
RENDER_SIZE = 256
YAWS = (0, 90, 180, 270)
# relation -> (axis: 0 = x, 1 = y; True when a comes first along it)
DIRECTIONS: dict[str, tuple[int, bool]] = {
    "left_of": (0, True),
    "right_of": (0, False),
    "in_front_of": (1, True),
    "behind": (1, False),
}

# type -> (x, y, z) size in metres at scale 1, along the object's own axes
CATALOG: dict[str, tuple[float, float, float]] = {
    "table": (1.2, 0.8, 0.75),
    "desk": (1.4, 0.7, 0.75),
    "chair": (0.5, 0.5, 0.9),
    "sofa": (2.0, 0.9, 0.8),
    "bed": (2.0, 1.6, 0.5),
    "shelf": (1.0, 0.4, 1.8),
    "crate": (0.6, 0.6, 0.6),
    "plant": (0.4, 0.4, 1.0),
    "lamp": (0.3, 0.3, 0.5),
    "box": (0.3, 0.3, 0.3),
    "tv": (1.0, 0.2, 0.6),
}
FLOOR_TYPES = ("table", "desk", "chair", "sofa", "bed", "shelf", "crate", "plant")
SURFACES = ("table", "desk")  # what small items go on top of
SMALL_TYPES = ("lamp", "box", "tv")
CONTAINERS = ("shelf", "crate")
COLORS: dict[str, tuple[int, int, int]] = {
    "table": (166, 118, 72),
    "desk": (140, 100, 60),
    "chair": (70, 110, 180),
    "sofa": (150, 60, 60),
    "bed": (120, 90, 160),
    "shelf": (90, 70, 50),
    "crate": (200, 160, 90),
    "plant": (60, 150, 70),
    "lamp": (230, 200, 60),
    "box": (220, 120, 40),
    "tv": (40, 40, 40),
}

SCENE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["objects"],
    "additionalProperties": False,
    "properties": {
        "objects": {
            "type": "array",
            "maxItems": MAX_OBJECTS,
            "items": {
                "type": "object",
                "required": ["id", "type", "position"],
                "additionalProperties": False,
                "properties": {
                    "id": {"type": "string", "minLength": 1, "maxLength": 64},
                    "type": {"enum": sorted(CATALOG)},
                    "position": {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3},
                    "rotation": {"enum": list(YAWS)},
                    "scale": {
                        "type": "array",
                        "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
                        "minItems": 3,
                        "maxItems": 3,
                    },
                    "parent": {"type": ["string", "null"]},
                },
            },
        }
    },
}


class SceneError(ValueError):
    """A reply that is not a valid scene; the message is the feedback the model gets."""


@dataclass
class Obj:
    id: str
    type: str
    x: float
    y: float
    z: float
    rotation: int = 0
    scale: tuple[float, float, float] = (1.0, 1.0, 1.0)
    parent: str | None = None

    @property
    def size(self) -> tuple[float, float, float]:
        sx, sy, sz = (c * s for c, s in zip(CATALOG[self.type], self.scale, strict=True))
        return (sy, sx, sz) if self.rotation in (90, 270) else (sx, sy, sz)

    @property
    def box(self) -> tuple[float, float, float, float, float, float]:
        """(xmin, xmax, ymin, ymax, zmin, zmax)."""
        w, d, h = self.size
        return (self.x - w / 2, self.x + w / 2, self.y - d / 2, self.y + d / 2, self.z, self.z + h)

    @property
    def front(self) -> tuple[float, float]:
        a = math.radians(self.rotation)
        return (round(-math.sin(a), 12), round(math.cos(a), 12))

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "position": [round(self.x, 3), round(self.y, 3), round(self.z, 3)],
            "rotation": self.rotation,
            "scale": list(self.scale),
            "parent": self.parent,
        }


@dataclass
class Scene:
    width: float
    depth: float
    objects: dict[str, Obj]

    def to_json(self) -> dict[str, Any]:
        return {"objects": [o.to_json() for o in self.objects.values()]}


def parse_scene(text: str, width: float, depth: float) -> Scene:
    """The scene in a reply, validated (schema, finite numbers, unique ids, parents that exist, no
    cycles); raises `SceneError` naming the problem."""
    import jsonschema

    obj, error = json_object_or_error(text[:MAX_REPLY_CHARS] if isinstance(text, str) else text)
    if obj is None:
        raise SceneError(error or "no JSON object")
    validator = jsonschema.Draft202012Validator(SCENE_SCHEMA)
    err = next(iter(sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))), None)
    if err is not None:
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise SceneError(f"schema violation at {where}: {err.message[:200]}")
    objects: dict[str, Obj] = {}
    for i, raw in enumerate(obj["objects"]):
        numbers = [*raw["position"], *raw.get("scale", [1, 1, 1])]
        if not all(math.isfinite(v) for v in numbers):
            raise SceneError(f"objects/{i}: position and scale must be finite numbers")
        if raw["id"] in objects:
            raise SceneError(f"objects/{i}: duplicate id '{raw['id']}'")
        x, y, z = (float(v) for v in raw["position"])
        scale = tuple(float(v) for v in raw.get("scale", [1, 1, 1]))
        objects[raw["id"]] = Obj(
            raw["id"],
            raw["type"],
            x,
            y,
            z,
            raw.get("rotation", 0),
            scale,
            raw.get("parent"),  # type: ignore[arg-type]
        )
    for o in objects.values():
        seen = {o.id}
        p = o.parent
        while p is not None:
            if p not in objects:
                raise SceneError(f"object '{o.id}': parent '{p}' is not an object of the scene")
            if p in seen:
                raise SceneError(f"object '{o.id}': its parents form a cycle")
            seen.add(p)
            p = objects[p].parent
    return Scene(width, depth, objects)


# --- the checker --------------------------------------------------------------------------------


def _rests_on(a: Obj, b: Obj) -> bool:
    ax0, ax1, ay0, ay1, az0, _ = a.box
    bx0, bx1, by0, by1, _, bz1 = b.box
    return (
        abs(az0 - bz1) <= 0.01
        and ax0 >= bx0 - TOL
        and ax1 <= bx1 + TOL
        and ay0 >= by0 - TOL
        and ay1 <= by1 + TOL
    )


def _inside(a: Obj, b: Obj) -> bool:
    """A small item (lamp, box, tv) within a container's (shelf, crate) box; nothing else is "inside"
    anything, so two copies of one object cannot excuse their overlap by declaring one the other's parent."""
    if a.type not in SMALL_TYPES or b.type not in CONTAINERS:
        return False
    return all(a.box[i] >= b.box[i] - TOL for i in (0, 2, 4)) and all(
        a.box[i] <= b.box[i] + TOL for i in (1, 3, 5)
    )


def _supported_by_parent(a: Obj, scene: Scene) -> bool:
    parent = scene.objects.get(a.parent) if a.parent else None
    return parent is not None and (_rests_on(a, parent) or _inside(a, parent))


def _intersect(a: Obj, b: Obj) -> bool:
    ab, bb = a.box, b.box
    return all(min(ab[i + 1], bb[i + 1]) - max(ab[i], bb[i]) > 1e-4 for i in (0, 2, 4))


def _fmt_box(o: Obj) -> str:
    b = o.box
    return f"x [{b[0]:.2f}, {b[1]:.2f}], y [{b[2]:.2f}, {b[3]:.2f}], z [{b[4]:.2f}, {b[5]:.2f}]"


def describe(c: dict[str, Any]) -> str:
    """A constraint in the brief's words."""
    k = c["kind"]
    if k == "named":
        return f"a {c['type']} with id '{c['id']}'"
    if k == "count":
        return f"exactly {c['n']} object(s) of type '{c['type']}' in the scene"
    if k in DIRECTIONS:
        return f"'{c['a']}' is {k.replace('_', ' ')} '{c['b']}'"
    if k == "on_top_of":
        return f"'{c['a']}' stands on top of '{c['b']}' (parent '{c['b']}')"
    if k == "inside":
        return f"'{c['a']}' is inside '{c['b']}' (parent '{c['b']}')"
    if k == "facing":
        return f"'{c['a']}' faces '{c['b']}'"
    if k == "near":
        return f"'{c['a']}' is within {c['d']} m of '{c['b']}' (centre to centre)"
    if k == "apart":
        return f"'{c['a']}' is at least {c['d']} m from '{c['b']}' (centre to centre)"
    if k == "no_overlap":
        return "no two objects overlap"
    if k == "within_bounds":
        return "every object lies inside the room"
    if k == "supported":
        return "every object stands on the floor (z = 0) or on/in its parent"
    raise ValueError(f"unknown constraint kind '{k}'")


def check_constraint(c: dict[str, Any], scene: Scene) -> tuple[bool, str]:
    """(satisfied, why not) for one constraint; never raises on a valid scene."""
    objs, k = scene.objects, c["kind"]
    if k == "count":
        n = sum(1 for o in objs.values() if o.type == c["type"])
        return n == c["n"], f"the scene has {n}"
    if k == "no_overlap":
        items = list(objs.values())
        for i, a in enumerate(items):
            for b in items[i + 1 :]:
                exempt = (a.parent == b.id and _supported_by_parent(a, scene)) or (
                    b.parent == a.id and _supported_by_parent(b, scene)
                )
                if not exempt and _intersect(a, b):
                    return False, f"'{a.id}' and '{b.id}' overlap"
        return True, ""
    if k == "within_bounds":
        for o in objs.values():
            b = o.box
            if b[0] < -TOL or b[1] > scene.width + TOL or b[2] < -TOL or b[3] > scene.depth + TOL:
                return False, f"'{o.id}' ({_fmt_box(o)}) leaves the {scene.width} x {scene.depth} m room"
            if b[4] < -TOL or b[5] > HEIGHT + TOL:
                return False, f"'{o.id}' ({_fmt_box(o)}) is below the floor or above the {HEIGHT} m ceiling"
        return True, ""
    if k == "supported":
        for o in objs.values():
            if o.parent is None and abs(o.z) > 0.01:
                return False, f"'{o.id}' floats at z = {o.z:.2f} with no parent"
            if o.parent is not None and not _supported_by_parent(o, scene):
                return False, f"'{o.id}' is neither on top of nor inside its parent '{o.parent}'"
        return True, ""
    a = objs.get(c["id"] if k == "named" else c["a"])
    if a is None:
        return False, f"there is no object '{c['id'] if k == 'named' else c['a']}'"
    if k == "named":
        return a.type == c["type"], f"'{a.id}' is a {a.type}"
    b = objs.get(c["b"])
    if b is None:
        return False, f"there is no object '{c['b']}'"
    ab, bb = a.box, b.box
    if k in DIRECTIONS:  # a's far side before b's near side along the axis (x: 0, y: 1)
        axis, before = DIRECTIONS[k]
        lo, hi = 2 * axis, 2 * axis + 1
        ok = ab[hi] <= bb[lo] + TOL if before else ab[lo] >= bb[hi] - TOL
        name = "xy"[axis]
        return (
            ok,
            f"'{a.id}' spans {name} [{ab[lo]:.2f}, {ab[hi]:.2f}], '{b.id}' {name} [{bb[lo]:.2f}, {bb[hi]:.2f}]",
        )
    if k == "on_top_of":
        ok = a.parent == b.id and _rests_on(a, b)
        return ok, f"'{a.id}' has parent {a.parent!r} and box {_fmt_box(a)}; '{b.id}' box {_fmt_box(b)}"
    if k == "inside":
        ok = a.parent == b.id and _inside(a, b)
        return ok, f"'{a.id}' has parent {a.parent!r} and box {_fmt_box(a)}; '{b.id}' box {_fmt_box(b)}"
    if k == "facing":
        dx, dy = b.x - a.x, b.y - a.y
        dist = math.hypot(dx, dy)
        fx, fy = a.front
        ok = dist > TOL and (fx * dx + fy * dy) / dist > math.cos(math.radians(45)) + 1e-9
        return (
            ok,
            f"'{a.id}' (rotation {a.rotation}) faces ({fx:+.0f}, {fy:+.0f}); '{b.id}' is at ({dx:+.2f}, {dy:+.2f})",
        )
    if k in ("near", "apart"):
        dist = math.hypot(b.x - a.x, b.y - a.y)
        ok = dist <= c["d"] + TOL if k == "near" else dist >= c["d"] - TOL
        return ok, f"the centres are {dist:.2f} m apart"
    raise ValueError(f"unknown constraint kind '{k}'")


def check_scene(scene: Scene, constraints: list[dict[str, Any]]) -> list[tuple[dict[str, Any], bool, str]]:
    return [(c, *check_constraint(c, scene)) for c in constraints]


# --- the render ---------------------------------------------------------------------------------


def render_topdown(scene: Scene, size: int = RENDER_SIZE) -> np.ndarray:
    """A top-down view (`size` x `size` RGB, uint8): the room, each footprint in its type's colour with
    its id, an arrow for where it faces. Headless (Pillow)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (250, 250, 250))
    draw = ImageDraw.Draw(img)
    margin = 12
    scale = (size - 2 * margin) / max(scene.width, scene.depth, 1e-3)

    def px(x: float, y: float) -> tuple[float, float]:  # y grows away from the camera: up on screen
        return (margin + x * scale, size - margin - y * scale)

    draw.rectangle([*px(0, scene.depth), *px(scene.width, 0)], outline=(0, 0, 0), fill=(235, 235, 225))
    for o in sorted(scene.objects.values(), key=lambda o: o.z):
        x0, x1, y0, y1, _, _ = o.box
        left, top = px(max(x0, -1e3), min(y1, 1e3))
        right, bottom = px(min(x1, 1e3), max(y0, -1e3))
        draw.rectangle([left, top, right, bottom], fill=COLORS[o.type], outline=(20, 20, 20))
        cx, cy = px(o.x, o.y)
        fx, fy = o.front
        draw.line([cx, cy, cx + fx * 10, cy - fy * 10], fill=(255, 255, 255), width=2)
        draw.text((left + 2, top + 1), o.id[:10], fill=(0, 0, 0))
    return np.asarray(img)


def scene_image(scene: Scene) -> ImagePart:
    """The render and its text description (what a text-only model reads instead)."""
    from posttrain.envs.images import encode_png

    parts = []
    for o in scene.objects.values():
        w, d, h = o.size
        on = f", parent {o.parent}" if o.parent else ""
        parts.append(
            f"{o.id} ({o.type}) at ({o.x:.2f}, {o.y:.2f}, {o.z:.2f}), {w:.2f} x {d:.2f} x {h:.2f} m, rotation {o.rotation}{on}"
        )
    desc = f"Top-down render of your scene in the {scene.width} x {scene.depth} m room: " + (
        "; ".join(parts) if parts else "empty"
    )
    return ImagePart(encode_png(render_topdown(scene)), desc)


# --- the generator ------------------------------------------------------------------------------


def _place_floor(rng: random.Random, scene: Scene, oid: str, otype: str, tries: int = 200) -> Obj | None:
    for _ in range(tries):
        yaw = rng.choice(YAWS)
        o = Obj(oid, otype, 0.0, 0.0, 0.0, yaw)
        w, d, _ = o.size
        if w + 0.2 > scene.width or d + 0.2 > scene.depth:
            continue
        o.x = round(rng.uniform(w / 2 + 0.1, scene.width - w / 2 - 0.1), 2)
        o.y = round(rng.uniform(d / 2 + 0.1, scene.depth - d / 2 - 0.1), 2)
        grown = Obj(oid, otype, o.x, o.y, 0.0, yaw, (1.4, 1.4, 1.0))  # keep 20 % clearance around it
        if not any(_intersect(grown, other) for other in scene.objects.values()):
            return o
    return None


def _face(a: Obj, b: Obj) -> None:
    """Turn `a` to the yaw whose front points most directly at `b`."""
    dx, dy = b.x - a.x, b.y - a.y
    a.rotation = max(
        YAWS, key=lambda yaw: -math.sin(math.radians(yaw)) * dx + math.cos(math.radians(yaw)) * dy
    )


def _relations_that_hold(scene: Scene, a: Obj, b: Obj) -> list[dict[str, Any]]:
    out = []
    for kind in (*DIRECTIONS, "facing"):
        c = {"kind": kind, "a": a.id, "b": b.id}
        if check_constraint(c, scene)[0]:
            out.append(c)
    dist = math.hypot(a.x - b.x, a.y - b.y)
    out.append({"kind": "near", "a": a.id, "b": b.id, "d": round(math.ceil(dist * 2 + 0.5) / 2, 1)})
    if dist >= 1.5:
        out.append({"kind": "apart", "a": a.id, "b": b.id, "d": round(math.floor(dist * 2 - 0.5) / 2, 1)})
    return out


LEVELS: dict[int, dict[str, Any]] = {
    0: {"floor": (1, 1), "small": 0, "count": False, "relations": 0},
    1: {"floor": (2, 2), "small": 0, "count": False, "relations": 1},
    2: {"floor": (2, 3), "small": 1, "count": True, "relations": 1},
    3: {"floor": (4, 5), "small": 2, "count": True, "relations": 3},
}


def generate(rng: random.Random, level: int) -> tuple[Scene, list[dict[str, Any]]] | None:
    """A reference scene and the constraints of its brief (all satisfied by it), or None to redraw."""
    spec = LEVELS[level]
    scene = Scene(float(rng.randint(4, 8)), float(rng.randint(4, 7)), {})
    counts: dict[str, int] = {}

    def new_id(t: str) -> str:
        counts[t] = counts.get(t, 0) + 1
        return f"{t}{counts[t]}"

    floor_types = list(FLOOR_TYPES)
    if spec["small"]:
        floor_types = [t for t in floor_types if t not in SURFACES]
        first = rng.choice(SURFACES)
        chosen = [first] + [rng.choice(floor_types) for _ in range(rng.randint(*spec["floor"]) - 1)]
    else:
        chosen = [rng.choice(floor_types) for _ in range(rng.randint(*spec["floor"]))]
    for t in chosen:
        o = _place_floor(rng, scene, new_id(t), t)
        if o is None:
            return None
        scene.objects[o.id] = o
    floor = list(scene.objects.values())
    constraints: list[dict[str, Any]] = [{"kind": "named", "id": o.id, "type": o.type} for o in floor]
    if spec["small"]:
        surface = floor[0]
        for _ in range(spec["small"]):
            t = rng.choice(SMALL_TYPES)
            o = Obj(new_id(t), t, surface.x, surface.y, surface.box[5], surface.rotation, parent=surface.id)
            taken = [c for c in scene.objects.values() if c.parent == surface.id]
            if taken:  # a second item goes beside the first along the surface's long side
                w = surface.size[0] if surface.size[0] >= surface.size[1] else surface.size[1]
                off = w / 4
                if surface.size[0] >= surface.size[1]:
                    taken[0].x, o.x = round(surface.x - off, 3), round(surface.x + off, 3)
                else:
                    taken[0].y, o.y = round(surface.y - off, 3), round(surface.y + off, 3)
            scene.objects[o.id] = o
        for o in [o for o in scene.objects.values() if o.parent]:
            constraints.append({"kind": "named", "id": o.id, "type": o.type})
            constraints.append({"kind": "on_top_of", "a": o.id, "b": o.parent})
    containers = [o for o in floor if o.type in CONTAINERS]
    if level >= 3 and containers:  # a box stored inside a shelf or crate, half way up
        c = containers[0]
        o = Obj(
            new_id("box"),
            "box",
            c.x,
            c.y,
            round(c.z + (c.size[2] - CATALOG["box"][2]) / 2, 3),
            c.rotation,
            parent=c.id,
        )
        scene.objects[o.id] = o
        constraints += [
            {"kind": "named", "id": o.id, "type": "box"},
            {"kind": "inside", "a": o.id, "b": c.id},
        ]
    if spec["count"]:
        free = [t for t in ("plant", "crate", "chair", "shelf") if t not in counts]
        if not free:
            return None
        t = rng.choice(free)
        n = rng.randint(1, 2)
        for _ in range(n):
            o = _place_floor(rng, scene, new_id(t), t)
            if o is None:
                return None
            scene.objects[o.id] = o
        constraints.append({"kind": "count", "type": t, "n": n})
    if spec["relations"]:
        if level >= 3:  # a chair turned to face something makes `facing` hold for the brief
            chairs = [o for o in floor if o.type == "chair"]
            others = [o for o in floor if o.type != "chair"]
            if chairs and others:
                _face(chairs[0], rng.choice(others))
        pairs = [(a, b) for a in floor for b in floor if a.id != b.id]
        rng.shuffle(pairs)
        chosen_rel: list[dict[str, Any]] = []
        for a, b in pairs:
            held = _relations_that_hold(scene, a, b)
            directional = [c for c in held if c["kind"] not in ("near", "apart")]
            pool = directional if level < 3 or not chosen_rel else held
            if pool:
                pick = rng.choice(pool)
                if all((p["a"], p["b"]) != (pick["a"], pick["b"]) for p in chosen_rel):
                    chosen_rel.append(pick)
            if len(chosen_rel) == spec["relations"]:
                break
        if len(chosen_rel) < spec["relations"]:
            return None
        constraints.extend(chosen_rel)
    if len(scene.objects) > 1:
        constraints.append({"kind": "no_overlap"})
    constraints += [{"kind": "within_bounds"}, {"kind": "supported"}]
    if not all(ok for _, ok, _ in check_scene(scene, constraints)):
        return None
    return scene, constraints


EXAMPLE = (
    "Example. Brief: a 5 x 4 m room; a bed with id 'bed1'; a lamp 'lamp1' on top of 'bed1'.\n"
    'Scene: {"objects": [{"id": "bed1", "type": "bed", "position": [2.5, 2.0, 0.0], "rotation": 0, '
    '"scale": [1, 1, 1], "parent": null}, {"id": "lamp1", "type": "lamp", "position": [2.5, 2.0, 0.5], '
    '"rotation": 0, "scale": [1, 1, 1], "parent": "bed1"}]}'
)


def brief_text(width: float, depth: float, constraints: list[dict[str, Any]], level: int) -> str:
    sizes = ", ".join(f"{t} {x} x {y} x {z}" for t, (x, y, z) in CATALOG.items())
    lines = [
        f"Lay out a scene in a {width:g} x {depth:g} m room (x from 0 to {width:g} left to right, y from 0 "
        f"to {depth:g} front to back, z up, ceiling at {HEIGHT:g} m). Requirements:",
        *(f"- {describe(c)}" for c in constraints),
        "",
        'Reply with one JSON object {"objects": [...]}; each object has "id", "type", "position" '
        '[x, y, z] (the centre of its footprint at its bottom face, metres), "rotation" (0, 90, 180 or '
        '270 degrees counter-clockwise seen from above; at 0 it faces +y), "scale" [sx, sy, sz] and '
        '"parent" (the id it stands on or in, or null).',
        f"Sizes at scale 1 (x by y by z, metres): {sizes}. A rotation of 90 or 270 swaps x and y.",
    ]
    if level == 0:
        lines += ["", EXAMPLE]
    return "\n".join(lines)


# --- the environment ----------------------------------------------------------------------------


def score_reply(
    text: str, meta: dict[str, Any]
) -> tuple[float, dict[str, float], dict[str, Any], Scene | None]:
    """(reward, components, info, scene or None) for one reply; never raises on any text."""
    try:
        scene = parse_scene(text, meta["width"], meta["depth"])
    except SceneError as e:
        return 0.0, {"constraints": 0.0, "format": 0.0, "success": 0.0}, {"error": str(e), "failed": []}, None
    results = check_scene(scene, meta["constraints"])
    frac = sum(ok for _, ok, _ in results) / len(results)
    failed = [f"{describe(c)}: {why}" for c, ok, why in results if not ok]
    rewards = {"constraints": frac, "format": 1.0, "success": float(not failed)}
    return (
        frac,
        rewards,
        {"error": None, "failed": failed, "satisfied": f"{len(results) - len(failed)}/{len(results)}"},
        scene,
    )


class SceneEnv(Environment):
    def __init__(self, turns: int) -> None:
        self.max_turns = turns
        self._task: Task | None = None
        self._turn = 0
        self._final: StepResult | None = None

    async def reset(self, task: Task) -> Observation:
        self._task, self._turn, self._final = task, 0, None
        return Observation(messages=list(task.prompt), tools=[])

    async def step(self, assistant_text: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        if self._final is not None:
            return self._final
        self._turn += 1
        reward, rewards, info, scene = score_reply(
            assistant_text if isinstance(assistant_text, str) else "", self._task.meta
        )
        info.update(turns=self._turn, infra_failure=False)
        if rewards["success"] == 1.0 or self._turn >= self.max_turns:
            self._final = StepResult(observations=[], reward=reward, done=True, rewards=rewards, info=info)
            return self._final
        if scene is None:
            feedback = [
                TextPart(
                    f"Your reply is not a valid scene: {info['error']}\nReply with the corrected JSON scene."
                )
            ]
        else:
            listing = "\n".join(f"- FAILED {f}" for f in info["failed"])
            feedback = [
                TextPart(f"Satisfied {info['satisfied']} requirements.\n{listing}"),
                scene_image(scene),
                TextPart("Reply with the whole corrected JSON scene."),
            ]
        return StepResult(
            observations=[Message("user", feedback)], reward=None, done=False, rewards=rewards, info=info
        )


@register_env("scene.layout")
class SceneLayoutDomain(Domain):
    description = "JSON game-scene layout under spatial constraints; top-down render as feedback"
    difficulties = sorted(LEVELS)

    def __init__(self, turns: int = 1) -> None:
        if not isinstance(turns, int) or isinstance(turns, bool) or not 1 <= turns <= 8:
            raise ValueError(f"scene.layout: 'turns' must be an int from 1 to 8, got {turns!r}")
        self.turns = turns

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        def make(rng: random.Random):
            drawn = generate(rng, difficulty)
            key = (
                json.dumps(drawn[1], sort_keys=True) + repr((drawn[0].width, drawn[0].depth))
                if drawn
                else f"none{rng.random()}"
            )

            def build() -> Task | None:
                if drawn is None:
                    return None
                scene, constraints = drawn
                text = brief_text(scene.width, scene.depth, constraints, difficulty)
                meta = {
                    "width": scene.width,
                    "depth": scene.depth,
                    "constraints": constraints,
                    "reference": scene.to_json(),
                    "turns": self.turns,
                }
                return Task(
                    id="", domain=self.name, difficulty=difficulty, prompt=[Message("user", text)], meta=meta
                )

            return key, build

        return self.draw(split, difficulty, index, seed, make)

    def reference(self, task: Task) -> list[str]:
        return [json.dumps(task.meta["reference"])]

    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> Environment:
        return SceneEnv(self.turns)
