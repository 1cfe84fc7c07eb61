"""Image and text content parts in messages: validation, OpenAI and JSON forms, and what a text-only
model reads in an image's place."""

from __future__ import annotations

import base64
import json
import struct

import numpy as np
import pytest

from posttrain.envs.images import encode_png
from posttrain.types import (
    MAX_IMAGE_BYTES,
    ContentError,
    ImagePart,
    Message,
    Task,
    TextPart,
    content_from_openai,
    content_text,
)


def png(width: int, height: int, rgb: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    return encode_png(np.full((height, width, 3), rgb, dtype=np.uint8))


def test_png_header_is_read_and_decodes_with_pillow():
    from io import BytesIO

    from PIL import Image

    img = ImagePart(png(7, 3), "a red bar")
    assert img.size == (7, 3)
    assert Image.open(BytesIO(img.png)).size == (7, 3)
    with pytest.raises(ValueError, match="uint8 array"):
        encode_png(np.zeros((2, 2), dtype=np.float32))
    assert img.as_text() == "[image] a red bar" and ImagePart(png(1, 1)).as_text() == "[image]"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"GIF89a" + b"\x00" * 40, "not a PNG"),
        (png(2, 2)[:20], "not a PNG"),
        (png(2, 2).replace(struct.pack(">II", 2, 2), struct.pack(">II", 0, 2), 1), "1..4096"),
        (png(2, 2).replace(struct.pack(">II", 2, 2), struct.pack(">II", 5000, 2), 1), "1..4096"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * (MAX_IMAGE_BYTES), "the limit is"),
    ],
)
def test_bad_images_get_errors_that_name_the_problem(data, needle):
    with pytest.raises(ContentError, match=needle):
        ImagePart(data)
    with pytest.raises(ContentError, match="not PNG bytes"):
        ImagePart("iVBORw0KGgo=")  # type: ignore[arg-type]


def test_openai_parts_parse_and_round_trip():
    img = ImagePart(png(4, 4, (0, 0, 255)), "blue square")
    msg = Message("user", [TextPart("look:"), img])
    wire = msg.to_openai()
    assert wire["content"][0] == {"type": "text", "text": "look:"}
    assert wire["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    parsed = content_from_openai(wire["content"])
    assert parsed[0] == TextPart("look:")
    assert parsed[1].png == img.png and parsed[1].description == ""  # OpenAI's form has no description
    # our own JSON form keeps the description and survives json
    again = content_from_openai(json.loads(json.dumps(msg.to_dict()))["content"])
    assert again == [TextPart("look:"), img]
    assert content_from_openai("plain") == "plain" and content_from_openai(None) == ""


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (
            [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
            r"content\[0\]: only PNG data URLs",
        ),
        (
            [{"type": "text", "text": "a"}, {"type": "audio"}],
            r"content\[1\]: unknown content part type 'audio'",
        ),
        ([{"type": "image", "png_base64": "%%%"}], r"content\[0\]: invalid base64"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,R0lGODlh"}}], "not a PNG"),
        ([{"type": "text"}], "needs a string 'text'"),
        (["just a string"], "expected an object"),
        (42, "expected a string or a list"),
    ],
)
def test_bad_content_is_rejected_with_the_index(raw, needle):
    with pytest.raises(ContentError, match=needle):
        content_from_openai(raw)


def test_text_view_and_task_json():
    img = ImagePart(png(2, 2), "volume 12.0 mm^3, 6 faces")
    msg = Message("user", [TextPart("Your part:"), img, TextPart("Fix it.")])
    assert msg.text == content_text(msg.content) == "Your part:\n[image] volume 12.0 mm^3, 6 faces\nFix it."
    assert msg.images == [img] and Message("user", "hi").images == []
    task = Task("t", "d", 0, [msg])
    d = json.loads(json.dumps(task.to_dict()))
    assert d["prompt"][0]["content"][1] == {
        "type": "image",
        "png_base64": base64.b64encode(img.png).decode(),
        "description": "volume 12.0 mm^3, 6 faces",
    }
