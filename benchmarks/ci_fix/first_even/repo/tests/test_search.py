from seq.search import first_even


def test_first():
    assert first_even([2, 3]) == 2


def test_later():
    assert first_even([1, 3, 8, 10]) == 8


def test_none():
    assert first_even([1, 3]) is None
