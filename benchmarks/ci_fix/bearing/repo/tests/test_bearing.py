import pytest

from nav.bearing import angle_deg


def test_axes():
    assert angle_deg(1, 0) == pytest.approx(0)
    assert angle_deg(0, 1) == pytest.approx(90)


def test_diagonal():
    assert angle_deg(-1, -1) == pytest.approx(-135)
