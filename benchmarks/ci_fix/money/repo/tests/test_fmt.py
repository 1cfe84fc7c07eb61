from money.fmt import fmt


def test_two_decimals():
    assert fmt(12.5) == "12.50 EUR"


def test_large():
    assert fmt(1234.567, "USD") == "1234.57 USD"
