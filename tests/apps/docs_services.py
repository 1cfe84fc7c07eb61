"""Fixtures of the document-pipeline tests: real Redis and PostgreSQL servers on loopback for a test
module, skipped (saying why) only when the Debian binaries are absent. Import them into a test module."""

from __future__ import annotations

import pytest

from posttrain.apps.docs import services


def _serve(factory):
    try:
        with factory() as url:
            yield url
    except services.ServiceUnavailable as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def redis_url():
    yield from _serve(services.redis_server)


@pytest.fixture(scope="module")
def postgres_url():
    yield from _serve(services.postgres_server)
