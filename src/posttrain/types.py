"""Plain dataclasses shared by every layer: messages and their content parts, tools, tasks,
trajectories, and a step's picks and groups.

No behaviour beyond (de)serialisation and validation lives here; each layer owns what it does with
these. Must not import torch (the sandbox and environments use these types without it).
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_IMAGE_BYTES = 8 * 1024 * 1024
MAX_IMAGE_SIDE = 4096
_DATA_URL_PREFIX = "data:image/png;base64,"


class ContentError(ValueError):
    """A message content part that cannot be used; the message names the part and the problem."""


@dataclass(frozen=True)
class TextPart:
    text: str

    def to_openai(self) -> dict[str, Any]:
        return {"type": "text", "text": self.text}


@dataclass(frozen=True)
class ImagePart:
    """A PNG image and the description a text-only model reads in its place (measured properties, a
    caption). Validated on construction: PNG signature, IHDR header, size limits."""

    png: bytes
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.png, bytes | bytearray):
            raise ContentError(f"image part holds {type(self.png).__name__}, not PNG bytes")
        if len(self.png) > MAX_IMAGE_BYTES:
            raise ContentError(f"image is {len(self.png)} bytes; the limit is {MAX_IMAGE_BYTES}")
        if len(self.png) < 24 or not self.png.startswith(PNG_SIGNATURE) or self.png[12:16] != b"IHDR":
            raise ContentError("image is not a PNG (no PNG signature and IHDR header)")
        w, h = self.size
        if not (0 < w <= MAX_IMAGE_SIDE and 0 < h <= MAX_IMAGE_SIDE):
            raise ContentError(f"image is {w}x{h} pixels; each side must be 1..{MAX_IMAGE_SIDE}")

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) from the PNG header."""
        w, h = struct.unpack(">II", self.png[16:24])
        return int(w), int(h)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.png).hexdigest()

    def data_url(self) -> str:
        return _DATA_URL_PREFIX + base64.b64encode(self.png).decode("ascii")

    def as_text(self) -> str:
        """What a text-only model sees in the image's place."""
        return f"[image] {self.description}" if self.description else "[image]"

    def to_openai(self) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": self.data_url()}}

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "image",
            "png_base64": base64.b64encode(self.png).decode("ascii"),
            "description": self.description,
        }


ContentPart = TextPart | ImagePart


def _b64(data: Any, where: str) -> bytes:
    if not isinstance(data, str):
        raise ContentError(f"{where}: expected a base64 string")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ContentError(f"{where}: invalid base64 ({e})") from None


def content_part_from_dict(raw: Any, where: str = "content part") -> ContentPart:
    """One part from OpenAI's format (`text`, `image_url` with a PNG data URL) or ours (`image`)."""
    if not isinstance(raw, dict):
        raise ContentError(f"{where}: expected an object with a 'type', got {type(raw).__name__}")
    kind = raw.get("type")
    if kind == "text":
        if not isinstance(raw.get("text"), str):
            raise ContentError(f"{where}: a text part needs a string 'text'")
        return TextPart(raw["text"])
    if kind == "image_url":
        spec = raw.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise ContentError(f"{where}: an image_url part needs 'image_url.url'")
        if not url.startswith(_DATA_URL_PREFIX):
            raise ContentError(
                f"{where}: only PNG data URLs ({_DATA_URL_PREFIX}...) are accepted, not remote URLs"
            )
        return ImagePart(_b64(url[len(_DATA_URL_PREFIX) :], where), raw.get("description", "") or "")
    if kind == "image":
        return ImagePart(_b64(raw.get("png_base64"), where), raw.get("description", "") or "")
    raise ContentError(
        f"{where}: unknown content part type {kind!r} (expected 'text', 'image_url' or 'image')"
    )


def content_from_openai(raw: Any, where: str = "content") -> str | list[ContentPart]:
    """A message's content: a string, or a list of content parts (validated, errors name the index)."""
    if raw is None:
        return ""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise ContentError(f"{where}: expected a string or a list of content parts")
    return [content_part_from_dict(p, f"{where}[{i}]") for i, p in enumerate(raw)]


def content_text(content: str | list[ContentPart]) -> str:
    """The content as a text-only model reads it: text parts as they are, each image replaced by its
    description (`ImagePart.as_text`), parts joined by newlines."""
    if isinstance(content, str):
        return content
    return "\n".join(p.text if isinstance(p, TextPart) else p.as_text() for p in content)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class Message:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str | list[ContentPart]
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """The content as a text-only model reads it (`content_text`)."""
        return content_text(self.content)

    @property
    def images(self) -> list[ImagePart]:
        return [] if isinstance(self.content, str) else [p for p in self.content if isinstance(p, ImagePart)]

    def _out(self, ours: bool) -> dict[str, Any]:
        """The message as a dict: OpenAI's form, or (`ours`) our JSON form, whose image parts keep their
        descriptions and whose tool calls keep their arguments as objects. Each part is encoded once."""
        if isinstance(self.content, str):
            content: str | list[dict[str, Any]] = self.content
        else:
            content = [
                p.to_dict() if ours and isinstance(p, ImagePart) else p.to_openai() for p in self.content
            ]
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            import json

            out["tool_calls"] = [
                asdict(c)
                if ours
                else {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable, images as our own `image` parts with their descriptions."""
        return self._out(ours=True)

    def to_openai(self) -> dict[str, Any]:
        return self._out(ours=False)


@dataclass
class ToolSpec:
    """An OpenAI-style function tool: name, description, JSON-Schema parameters."""

    name: str
    description: str
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class Task:
    id: str
    domain: str
    difficulty: int
    prompt: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    split: str = "train"  # "train" | "heldout" | "eval"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prompt": [m.to_dict() for m in self.prompt]}


class TrajectoryStatus(enum.StrEnum):
    """`OK`/`TRUNCATED` are scored; the *_ERROR statuses are never trained on: SANDBOX/ENGINE/REWARD_ERROR
    are infrastructure failures, REWARD_FN_ERROR is the user's reward function failing (it raised or gave
    no finite number), a user error the run stops on (orchestrator.max_reward_fn_errors)."""

    OK = "ok"
    TRUNCATED = "truncated"  # hit the turn or token budget; still scored
    SANDBOX_ERROR = "sandbox_error"
    ENGINE_ERROR = "engine_error"
    REWARD_ERROR = "reward_error"  # the learned reward model (or its server) failed to score it
    REWARD_FN_ERROR = "reward_fn_error"  # the user's reward function raised or returned no finite number

    @property
    def is_infra_failure(self) -> bool:
        return self in (
            TrajectoryStatus.SANDBOX_ERROR,
            TrajectoryStatus.ENGINE_ERROR,
            TrajectoryStatus.REWARD_ERROR,
        )

    @property
    def is_scored(self) -> bool:
        """The episode has a reward to train on and report: neither an infrastructure failure nor a
        reward-function error."""
        return not self.is_infra_failure and self is not TrajectoryStatus.REWARD_FN_ERROR


@dataclass
class Trajectory:
    """One episode as the trainer sees it.

    `token_ids[:prompt_len]` is the rendered prompt; after it come the engine's sampled ids and the ids
    of appended observations, exactly as fed to the engine. `loss_mask[i] == 1` only where the engine
    sampled token i; `behavior_logprobs[i]` is its logprob under the sampling distribution (0.0 where
    the mask is 0). All three lists have the same length. `images` are the image parts of the prompt and
    of the observations that entered `token_ids`, in order of appearance. `routing` (MoE policies on
    the paged engine; None when unknown): for positions 0 .. len(token_ids) - 2, the expert ids the
    engine chose at each sparse layer when it fed that token, `[position][layer][top_k]` (each turn's
    completion adds the positions it fed first; earlier positions keep the turn that fed them first).
    `clipped`: the last turn's completion stopped at its token limit (finish_reason "length"), not on a
    stop token: the environment scored a cut-off answer.
    """

    task: Task
    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    prompt_len: int
    rewards: dict[str, float] = field(default_factory=dict)
    reward: float = 0.0
    turns: int = 0
    policy_version: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    status: TrajectoryStatus = TrajectoryStatus.OK
    info: dict[str, Any] = field(default_factory=dict)
    group_id: int = 0
    images: list[ImagePart] = field(default_factory=list)  # of the prompt and the observations fed, in order
    routing: list[list[list[int]]] | None = None
    clipped: bool = False

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True)
class Pick:
    """One group to roll out: the curriculum arm that chose it (`curriculum.Arm`; None where no curriculum
    picks, e.g. sampled preference pairs), its environment (`envs.Domain`), the task, and the prompt's index
    within the arm. Typed loosely here: this module sits below the layers that own arms and domains."""

    arm: Any
    domain: Any
    task: Task
    prompt: int


@dataclass
class Group:
    """The episodes of one task rolled out together (a GRPO group), made once by the collector from its
    `Pick`: every member carries `group_id` (the step's group offset plus the pick's position). `members`
    holds infrastructure failures and reward-function errors too; `scored` leaves them out (they are counted,
    never trained on)."""

    task: Task
    arm: Any
    prompt: int
    group_id: int
    members: list[Trajectory]

    @property
    def scored(self) -> list[Trajectory]:
        return [t for t in self.members if t.status.is_scored]
