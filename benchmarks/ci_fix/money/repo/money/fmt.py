"""Format amounts of money."""


def fmt(amount, currency="EUR"):
    """'12.50 EUR' for 12.5."""
    return f"{amount:.2} {currency}"
