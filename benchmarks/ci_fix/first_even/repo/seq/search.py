"""Searching sequences."""


def first_even(xs):
    """The first even number of `xs`, or None."""
    for x in xs:
        if x % 2 == 0:
            return x
        else:
            return None
