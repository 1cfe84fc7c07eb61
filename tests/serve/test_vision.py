"""`posttrain serve` with a vision model: image content parts (PNG data URLs) through the OpenAI client
answer as the engine does for the same prompt and image, for a folder of each tiny VLM family loaded
the way `posttrain serve FOLDER` loads it; bad images get a 400 naming the part; the graft saves as an
HF folder that loads and answers through the server (slow)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams
from posttrain.envs.images import encode_png, image_part
from posttrain.models.vision import encode_with_images, family, save_vision_folder, tiny_llava
from posttrain.serve import ModelEntry, ServeSettings, ServeState, load_entries, resolve_source
from posttrain.types import MAX_IMAGE_SIDE, Message, TextPart

from .conftest import start_server

MAX_LEN = 512


def noise_image(seed: int):
    return image_part(np.random.RandomState(seed).randint(0, 255, (40, 50, 3)).astype(np.uint8), "noise")


@pytest.fixture(scope="module")
def llava():
    return tiny_llava(0)


def _engine(model, tok) -> PagedEngine:
    return PagedEngine(model, tok, num_blocks=128, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def vlm_live(llava):
    model, tok = llava
    state = ServeState(ServeSettings(max_queue=8, max_running=4))
    state.add_model(ModelEntry("vlm", _engine(model, tok), tok, max_model_len=MAX_LEN))
    srv = start_server(state)
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=["llava", "idefics3", "qwen2_vl"])
def served_folder(request, tmp_path_factory):
    """(live server, engine over the same folder): tiny:<family> saved as an HF folder and served as
    `posttrain serve FOLDER --set engine.dtype=float32` loads it (resolve_source + load_entries)."""
    from posttrain.config import load_config
    from posttrain.models import load_policy, load_tokenizer

    model, tok = family(request.param).tiny(0)
    folder = str(save_vision_folder(model, tok, tmp_path_factory.mktemp(request.param) / "vlm"))
    sets = ["engine.dtype=float32", f"engine.max_model_len={MAX_LEN}", "engine.num_kv_blocks=128"]
    source = resolve_source(folder, load_config(None, sets), sets, "vlm")
    state = ServeState(ServeSettings(max_queue=8, max_running=4))
    for entry in load_entries(source):
        state.add_model(entry)
    srv = start_server(state)
    yield srv, load_policy(folder), load_tokenizer(folder)
    srv.stop()


def _post(live, messages, **extra):
    body = {"model": "vlm", "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)


def test_image_parts_answer_as_the_engine_does(served_folder):
    import openai

    live, model, tok = served_folder
    img = noise_image(4)
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": img.data_url()}},
    ]
    out = client.chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0
    )
    ids, images = encode_with_images(tok, [Message("user", [TextPart("what is this?"), img])])
    want = _engine(model, tok).generate(
        [GenerationRequest(ids, SamplingParams(temperature=0, max_tokens=8), images=images)]
    )
    assert out.choices[0].message.content == want[0].completions[0].text
    assert out.usage.prompt_tokens == len(ids)


def test_bad_images_get_a_400_naming_the_part(vlm_live):
    def err(content):
        r = _post(vlm_live, [{"role": "system", "content": "hi"}, {"role": "user", "content": content}])
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]

    text = {"type": "text", "text": "look"}
    broken = base64.b64encode(noise_image(0).png[:40] + b"\x00" * 30).decode()
    msg = err([text, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + broken}}])
    assert msg.startswith("messages[1].content[1]") and "does not decode" in msg
    msg = err([text, {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}])
    assert msg.startswith("messages[1].content[1]") and "invalid base64" in msg
    msg = err([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}])
    assert msg.startswith("messages[1].content[0]") and "remote URLs" in msg
    wide = encode_png(np.zeros((1, MAX_IMAGE_SIDE + 1, 3), dtype=np.uint8))  # a few hundred bytes
    url = "data:image/png;base64," + base64.b64encode(wide).decode()
    msg = err([text, {"type": "image_url", "image_url": {"url": url}}])
    assert msg.startswith("messages[1].content[1]") and f"each side must be 1..{MAX_IMAGE_SIDE}" in msg


@pytest.mark.slow
def test_the_graft_saves_loads_and_answers_through_the_server(tmp_path):
    from typer.testing import CliRunner

    from posttrain.cli import app
    from posttrain.models import load_policy, load_tokenizer

    res = CliRunner().invoke(
        app, ["models", "graft-vision", "--out", str(tmp_path / "g"), "--vision-layers", "1"]
    )
    assert res.exit_code == 0, res.output
    assert "36 image tokens per 96px image" in res.output
    model, tok = load_policy(str(tmp_path / "g")), load_tokenizer(str(tmp_path / "g"))
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert model.config.text_config.num_hidden_layers == 30  # SmolLM2-135M's language model
    state = ServeState(ServeSettings(max_queue=4, max_running=2))
    state.add_model(ModelEntry("vlm", _engine(model, tok), tok, max_model_len=MAX_LEN))
    srv = start_server(state)
    try:
        content = [
            {"type": "text", "text": "Describe the image."},
            {"type": "image_url", "image_url": {"url": noise_image(1).data_url()}},
        ]
        r = _post(srv, [{"role": "user", "content": content}])
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        srv.stop()
