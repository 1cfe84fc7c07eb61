"""Fixtures for the long-context tests."""

from __future__ import annotations

import pytest

from posttrain.models import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("tiny:llama")
