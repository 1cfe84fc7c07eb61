"""Averages of score lists."""


def average(xs):
    if not xs:
        raise ValueError("average of an empty list")
    return sum(xs) // len(xs)
