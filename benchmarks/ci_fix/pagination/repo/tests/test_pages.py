from paginate.pages import page, page_count


def test_page_count():
    assert page_count(10, 3) == 4
    assert page_count(9, 3) == 3


def test_first_page():
    assert page(list(range(10)), 0, 3) == [0, 1, 2]


def test_last_page():
    assert page(list(range(10)), 3, 3) == [9]
