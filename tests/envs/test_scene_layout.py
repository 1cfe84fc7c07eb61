"""scene.layout: the checker against hand-computed geometry, attacks on it, the render, and the
multi-turn variant's feedback."""

from __future__ import annotations

import json
from io import BytesIO

import pytest
from PIL import Image

from posttrain.envs import get_domain, run_episode
from posttrain.envs.domains.scene_layout import (
    SceneError,
    check_constraint,
    parse_scene,
    render_topdown,
    scene_image,
    score_reply,
)
from posttrain.types import ImagePart, TextPart

from .conftest import run


def obj(id_, type_, x, y, z=0.0, rotation=0, scale=(1, 1, 1), parent=None):
    return {
        "id": id_,
        "type": type_,
        "position": [x, y, z],
        "rotation": rotation,
        "scale": list(scale),
        "parent": parent,
    }


def scene(*objects, width=5.0, depth=4.0):
    return parse_scene(json.dumps({"objects": list(objects)}), width, depth)


def ok(kind, s, **kw):
    return check_constraint({"kind": kind, **kw}, s)[0]


def test_boxes_relations_and_rotation_by_hand():
    # table 1.2 x 0.8 at (2, 2): x [1.4, 2.6], y [1.6, 2.4]; chair 0.5 x 0.5 at (0.5, 2): x [0.25, 0.75]
    s = scene(obj("t", "table", 2, 2), obj("c", "chair", 0.5, 2))
    assert s.objects["t"].box == pytest.approx((1.4, 2.6, 1.6, 2.4, 0.0, 0.75))
    assert ok("left_of", s, a="c", b="t") and not ok("right_of", s, a="c", b="t")
    assert ok("right_of", s, a="t", b="c")
    assert not ok("in_front_of", s, a="c", b="t") and not ok("behind", s, a="c", b="t")
    # rotated 90 degrees the table's footprint is 0.8 x 1.2: x [1.6, 2.4]
    r = scene(obj("t", "table", 2, 2, rotation=90))
    assert r.objects["t"].box[:4] == pytest.approx((1.6, 2.4, 1.4, 2.6))
    # scale multiplies along the object's own axes before the rotation
    sc = scene(obj("t", "table", 2, 2, rotation=90, scale=(2, 1, 1)))
    assert sc.objects["t"].size == pytest.approx((0.8, 2.4, 0.75))
    # distance of centres 1.5 m
    assert ok("near", s, a="c", b="t", d=1.5) and not ok("near", s, a="c", b="t", d=1.4)
    assert ok("apart", s, a="c", b="t", d=1.5) and not ok("apart", s, a="c", b="t", d=1.6)


def test_facing_by_yaw():
    # yaw 270 turns the front from +y to +x: the chair at x = 0.5 faces the table at x = 2
    for yaw, facing in ((270, True), (90, False), (0, False), (180, False)):
        s = scene(obj("t", "table", 2, 2), obj("c", "chair", 0.5, 2, rotation=yaw))
        assert ok("facing", s, a="c", b="t") is facing, yaw
    # 45 degrees off-axis is not within the (open) 45-degree cone; 40 degrees is
    assert not ok("facing", scene(obj("c", "chair", 0, 0, rotation=0), obj("t", "table", 2, 2)), a="c", b="t")
    s = scene(obj("c", "chair", 1, 0.5, rotation=0), obj("t", "table", 2.0, 0.5 + 1 / 0.8391))
    assert ok("facing", s, a="c", b="t")


def test_on_top_of_inside_and_support():
    base = obj("t", "table", 2, 2)
    assert ok("on_top_of", scene(base, obj("l", "lamp", 2, 2, 0.75, parent="t")), a="l", b="t")
    assert ok("on_top_of", scene(base, obj("l", "lamp", 2, 2, 0.759, parent="t")), a="l", b="t")  # < 1 cm
    assert not ok("on_top_of", scene(base, obj("l", "lamp", 2, 2, 0.77, parent="t")), a="l", b="t")
    assert not ok("on_top_of", scene(base, obj("l", "lamp", 2, 2, 0.75)), a="l", b="t")  # no parent
    # the lamp's footprint x [2.4, 2.7] leaves the table's x [1.4, 2.6]
    assert not ok("on_top_of", scene(base, obj("l", "lamp", 2.55, 2, 0.75, parent="t")), a="l", b="t")
    shelf = obj("s", "shelf", 2, 1, 0)
    assert ok("inside", scene(shelf, obj("b", "box", 2, 1, 0.5, parent="s")), a="b", b="s")
    assert not ok(
        "inside", scene(shelf, obj("b", "box", 2, 1, 1.6, parent="s")), a="b", b="s"
    )  # top 1.9 > 1.8
    floating = scene(obj("p", "plant", 1, 1, 0.5))
    assert not ok("supported", floating) and ok("supported", scene(obj("p", "plant", 1, 1)))


def test_overlap_and_bounds():
    assert not ok("no_overlap", scene(obj("a", "chair", 1, 1), obj("b", "chair", 1.4, 1)))
    assert ok("no_overlap", scene(obj("a", "chair", 1, 1), obj("b", "chair", 1.5, 1)))  # touching is allowed
    assert ok("within_bounds", scene(obj("a", "chair", 0.25, 0.25)))
    assert not ok("within_bounds", scene(obj("a", "chair", 0.2, 1)))
    assert not ok("within_bounds", scene(obj("a", "shelf", 1, 1, scale=(1, 1, 2))))  # 3.6 m > ceiling


def test_a_declared_parent_does_not_excuse_an_overlap():
    """Setting `parent` everywhere must not switch off the overlap check: only a child that really
    rests on or in its parent is exempt."""
    s = scene(obj("a", "chair", 1, 1), obj("b", "chair", 1, 1, parent="a"))
    assert not ok("no_overlap", s) and not ok("supported", s)
    s = scene(obj("a", "crate", 1, 1), obj("b", "crate", 1, 1, parent="a"))  # a crate is no box
    assert not ok("no_overlap", s) and not ok("inside", s, a="b", b="a")
    s = scene(obj("t", "table", 2, 2), obj("l", "lamp", 2, 2, 0.75, parent="t"))
    assert ok("no_overlap", s) and ok("supported", s)
    s = scene(obj("c", "crate", 1, 1), obj("b", "box", 1, 1, 0.1, parent="c"))
    assert ok("no_overlap", s) and ok("supported", s) and ok("inside", s, a="b", b="c")


@pytest.mark.parametrize(
    ("reply", "needle"),
    [
        ("not json at all", "no JSON object"),
        ('{"objects": [', "invalid JSON"),
        ("[1, 2]", "no JSON object"),
        ('{"objects": [{"id": "a", "type": "chair", "position": [NaN, 1, 0]}]}', "finite"),
        ('{"objects": [{"id": "a", "type": "chair", "position": [1e999, 1, 0]}]}', "finite"),
        ('{"objects": [{"id": "a", "type": "dragon", "position": [1, 1, 0]}]}', "objects/0/type"),
        ('{"objects": [{"id": "a", "type": "chair", "position": [1, 1]}]}', "objects/0/position"),
        ('{"objects": [{"id": "a", "type": "chair", "position": [1, 1, 0], "rotation": 45}]}', "rotation"),
        ('{"objects": [{"id": "a", "type": "chair", "position": [1, 1, 0], "scale": [1, -1, 1]}]}', "scale"),
        ('{"objects": [{"id": "a", "type": "chair", "position": [1, 1, 0], "hp": 3}]}', "hp"),
        (json.dumps({"objects": [obj("a", "chair", 1, 1), obj("a", "box", 2, 2)]}), "duplicate id 'a'"),
        (json.dumps({"objects": [obj("a", "chair", 1, 1, parent="ghost")]}), "parent 'ghost'"),
        (
            json.dumps({"objects": [obj("a", "box", 1, 1, parent="b"), obj("b", "box", 1, 1, parent="a")]}),
            "cycle",
        ),
        (json.dumps({"objects": [obj(f"o{i}", "box", 1, 1) for i in range(65)]}), "objects"),
        ("{" * 100_000, "invalid JSON"),
    ],
)
def test_invalid_scenes_are_rejected_with_the_reason(reply, needle):
    with pytest.raises(SceneError, match=needle):
        parse_scene(reply, 5.0, 4.0)
    reward, rewards, info, parsed = score_reply(
        reply, {"width": 5.0, "depth": 4.0, "constraints": [{"kind": "within_bounds"}]}
    )
    assert reward == 0.0 and rewards == {"constraints": 0.0, "format": 0.0, "success": 0.0} and parsed is None
    assert needle.split("'")[0] in info["error"]


def test_counts_are_exact_so_spraying_objects_does_not_pay():
    d = get_domain("scene.layout")
    task = next(
        t
        for t in (d.task("train", 2, i) for i in range(20))
        if any(c["kind"] == "count" for c in t.meta["constraints"])
    )
    count = next(c for c in task.meta["constraints"] if c["kind"] == "count")
    ref = task.meta["reference"]
    spray = {"objects": ref["objects"] + [obj(f"extra{i}", count["type"], 0.3, 0.3) for i in range(5)]}
    reward, rewards, info, _ = score_reply(json.dumps(spray), task.meta)
    assert rewards["success"] == 0.0 and reward < 1.0
    assert any("exactly" in f for f in info["failed"])


def test_render_is_a_png_of_the_stated_size_and_follows_the_scene():
    a = scene(obj("t", "table", 2, 2))
    b = scene(obj("t", "table", 3, 2))
    img_a, img_b = scene_image(a), scene_image(b)
    assert isinstance(img_a, ImagePart) and img_a.size == (256, 256)
    assert Image.open(BytesIO(img_a.png)).size == (256, 256)
    assert img_a.png != img_b.png and (render_topdown(a) != render_topdown(b)).any()
    assert "t (table) at (2.00, 2.00, 0.00), 1.20 x 0.80 x 0.75 m" in img_a.description
    # the table is drawn in its colour at its place: pixel at the centre of the footprint
    px = render_topdown(a)
    margin, scale = 12, (256 - 24) / 5.0
    assert tuple(px[int(256 - margin - 2 * scale) - 5, int(margin + 2 * scale) + 8]) == (166, 118, 72)


def test_multi_turn_feedback_then_fix():
    d = get_domain("scene.layout", turns=3)
    task = d.task("train", 1, 0)
    ref = d.reference(task)[0]
    wrong = json.loads(ref)
    wrong["objects"][0]["position"][0] = 100.0  # leaves the room
    res = run(run_episode(d.make_env(None), task, ["{broken", json.dumps(wrong), ref]))
    assert res.done and res.reward == 1.0 and res.rewards["success"] == 1.0 and res.info["turns"] == 3
    first, second = res.transcript[2], res.transcript[4]  # user observations after turns 1 and 2
    assert (
        isinstance(first.content[0], TextPart) and "not a valid scene: invalid JSON" in first.content[0].text
    )
    assert not first.images
    assert len(second.images) == 1 and second.images[0].size == (256, 256)
    assert "FAILED every object lies inside the room" in second.text
    # a single-turn domain scores the first reply and stops
    once = run(run_episode(get_domain("scene.layout").make_env(None), task, [json.dumps(wrong), ref]))
    assert once.done and once.info["turns"] == 1 and once.rewards["success"] == 0.0


def test_turns_option_is_validated():
    with pytest.raises(ValueError, match="'turns' must be an int from 1 to 8"):
        get_domain("scene.layout", turns=0)
