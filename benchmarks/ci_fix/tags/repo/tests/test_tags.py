from tagging.tags import normalise, with_tag


def test_fresh_lists():
    assert with_tag("a") == ["a"]
    assert with_tag("b") == ["b"]


def test_callers_list_untouched():
    mine = ["x"]
    assert with_tag("y", mine) == ["x", "y"]
    assert mine == ["x"]


def test_normalise():
    assert normalise(" Big Data ") == "big-data"
