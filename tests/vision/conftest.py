"""Fixtures for the vision tests: the tiny random VLM of each family, and `vlm`, parametrised over them."""

from __future__ import annotations

import pytest

from posttrain.models.vision import tiny_llava
from posttrain.models.vision_idefics3 import tiny_idefics3


@pytest.fixture(scope="session")
def llava():
    """(model, tokenizer) of tiny:llava, seed 0."""
    return tiny_llava(0)


@pytest.fixture(scope="session")
def idefics3():
    """(model, tokenizer) of tiny:idefics3, seed 0."""
    return tiny_idefics3(0)


@pytest.fixture(scope="session", params=["llava", "idefics3"])
def vlm(request):
    """(model, tokenizer) of each tiny VLM family (its spec: `tiny:<image_inputs(tok).family.name>`)."""
    return request.getfixturevalue(request.param)
