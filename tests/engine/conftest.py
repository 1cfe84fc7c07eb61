"""Fixtures for the engine tests."""

from __future__ import annotations

import pytest

from posttrain.models import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("tiny:llama")
