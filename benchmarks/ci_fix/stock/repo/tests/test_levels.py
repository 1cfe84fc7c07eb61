from stock.levels import drop_empty, total


def test_drop_empty():
    assert drop_empty({"a": 0, "b": 2, "c": 0}) == {"b": 2}


def test_total():
    assert total({"a": 1, "b": 2}) == 3
