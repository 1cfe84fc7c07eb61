"""Images of sampled episodes (the renders environments fed back as observations) saved into the run
directory: `renders/step_NNNNNN/<k>_<j>.png` and one `renders/index.jsonl` line per episode (step,
task, reward, success, each image's file and description). The report shows the latest ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the report reads renders without importing the layers that make them
    from posttrain.types import Trajectory

INDEX = "index.jsonl"


def save_renders(root: str | Path, step: int, trajectories: list[Trajectory], limit: int) -> int:
    """Write the images of the first `limit` trajectories that have any; returns how many episodes."""
    root = Path(root)
    chosen = [t for t in trajectories if t.images][:limit]
    if not chosen:
        return 0
    folder = root / f"step_{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for k, traj in enumerate(chosen):
        images = []
        for j, img in enumerate(traj.images):
            name = f"{k}_{j}.png"
            (folder / name).write_bytes(img.png)
            images.append({"file": f"{folder.name}/{name}", "description": img.description})
        lines.append(
            {
                "step": step,
                "task": traj.task.id,
                "domain": traj.task.domain,
                "reward": traj.reward,
                "success": traj.rewards.get("success"),
                "turns": traj.turns,
                "images": images,
            }
        )
    with open(root / INDEX, "a") as fh:
        fh.writelines(json.dumps(line) + "\n" for line in lines)
    return len(chosen)


def read_renders(root: str | Path) -> list[dict[str, Any]]:
    """The index's episodes, oldest first; [] when none were saved."""
    path = Path(root) / INDEX
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
