"""Image-caption pairs for the supervised alignment stage: the `vision.*` domains' renders (shape scenes,
panels, bar charts, CAD drawings) with a caption built from each task's ground truth, as OpenAI-style
chat rows (`{"messages": [user: text + image_url part, assistant: caption]}`) that `posttrain sft
--data` reads. The renders and splits are the domains' own; this module only writes captions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrain.envs.base import TRAIN
from posttrain.types import Task

CAPTION_PROMPT = "Describe the image."
CAPTION_DOMAINS = ("vision.shapes", "vision.views", "vision.chart", "vision.cad_drawing")


def _a(kind: str, colour: str) -> str:
    return f"a {colour} {kind}"


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def caption_of(task: Task) -> str:
    """The caption of a `vision.*` task's image, from the task's ground truth alone."""
    meta = task.meta
    if task.domain == "vision.shapes":
        shapes = sorted(meta["shapes"], key=lambda s: (s["cx"], s["cy"]))
        n = len(shapes)
        what = _listing([_a(s["kind"], s["colour"]) for s in shapes])
        return f"{n} shape{'s' if n != 1 else ''} on a light background, from left to right: {what}."
    if task.domain == "vision.views":
        panels = meta["panels"]
        words = {2: "Two panels", 4: "Four panels"}[len(panels)]
        shown = _listing([f"{'ABCD'[i]} shows {_a(k, c)}" for i, (k, c) in enumerate(panels)])
        return f"{words}: {shown}."
    if task.domain == "vision.chart":
        table = meta["table"]
        values = ", ".join(f"{year}: {value}" for year, value in table.items())
        return f"A bar chart of a company's yearly revenue in $M, {len(table)} years: {values}."
    if task.domain == "vision.cad_drawing":
        return f"An engineering drawing (top, front and right side views, dimensions in mm) of this part: {meta['part']}"
    raise ValueError(f"no captions for domain {task.domain!r} (captioned: {', '.join(CAPTION_DOMAINS)})")


def caption_rows(
    n: int, split: str = TRAIN, seed: int = 0, domains: tuple[str, ...] | list[str] = CAPTION_DOMAINS
) -> list[dict[str, Any]]:
    """`n` SFT rows, round-robin over every (domain, level) of `domains`, level by level (level 0 of each
    domain first): row i is task i // pairs of pair i % pairs, so the same arguments give the same rows
    and `split` keeps the domains' split."""
    from posttrain.envs import get_domain

    unknown = [d for d in domains if d not in CAPTION_DOMAINS]
    if unknown or not domains:
        raise ValueError(
            f"no captions for domain {unknown[0] if unknown else '(none given)'!r} "
            f"(captioned: {', '.join(CAPTION_DOMAINS)})"
        )
    found = [get_domain(name) for name in domains]
    levels = sorted({level for d in found for level in d.difficulties})
    pairs = [(d, level) for level in levels for d in found if level in d.difficulties]
    rows = []
    for i in range(n):
        domain, level = pairs[i % len(pairs)]
        task = domain.task(split, level, i // len(pairs), seed)
        (image,) = task.prompt[0].images
        rows.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": CAPTION_PROMPT}, image.to_openai()],
                    },
                    {"role": "assistant", "content": caption_of(task)},
                ],
                "source": task.id,
            }
        )
    return rows


def write_caption_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write `rows` as JSONL (one row a line) to `path`, creating its folder."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return out
