from parsing.numbers import parse_int


def test_number():
    assert parse_int(" 42 ") == 42


def test_not_a_number():
    assert parse_int("forty-two") == 0
    assert parse_int("", default=-1) == -1
