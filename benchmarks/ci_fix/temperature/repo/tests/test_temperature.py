import pytest

from units.temperature import c_to_f, f_to_c


def test_boiling():
    assert c_to_f(100) == 212


def test_freezing_back():
    assert f_to_c(32) == 0


@pytest.mark.parametrize("c", [-40, 0, 37])
def test_round_trip(c):
    assert f_to_c(c_to_f(c)) == pytest.approx(c)
