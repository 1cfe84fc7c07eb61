import pytest

from scores.average import average


def test_whole():
    assert average([2, 4]) == 3


def test_fraction():
    assert average([1, 2]) == 1.5


def test_empty():
    with pytest.raises(ValueError):
        average([])
