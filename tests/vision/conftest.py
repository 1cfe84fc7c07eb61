"""Fixtures for the vision tests."""

from __future__ import annotations

import pytest

from posttrain.models.vision import tiny_llava


@pytest.fixture(scope="session")
def llava():
    """(model, tokenizer) of tiny:llava, seed 0."""
    return tiny_llava(0)
