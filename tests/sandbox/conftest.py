import pytest

from posttrain.sandbox import LocalSandbox


@pytest.fixture(scope="session")
def sandbox():
    sb = LocalSandbox()
    yield sb
    sb.close_blocking()
