import pytest

from spread.summary import describe


def test_describe():
    d = describe([2, 4, 4, 4, 5, 5, 7, 9])
    assert d["n"] == 8 and d["mean"] == 5
    assert d["sd"] == pytest.approx(2.138, abs=1e-3)
