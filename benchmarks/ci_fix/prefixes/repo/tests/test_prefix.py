from names.prefix import drop_prefix


def test_simple():
    assert drop_prefix("test_value", "test_") == "value"


def test_keeps_following_letters():
    assert drop_prefix("get_token", "get_") == "token"
    assert drop_prefix("ab_abc", "ab_") == "abc"


def test_no_prefix():
    assert drop_prefix("value", "test_") == "value"
