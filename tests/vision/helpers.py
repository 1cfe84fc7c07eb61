"""Helpers for the vision tests: images."""

from __future__ import annotations

import numpy as np

from posttrain.envs.images import image_part


def noise_image(seed: int, h: int = 40, w: int = 50, description: str = "noise"):
    return image_part(np.random.RandomState(seed).randint(0, 255, (h, w, 3)).astype(np.uint8), description)
