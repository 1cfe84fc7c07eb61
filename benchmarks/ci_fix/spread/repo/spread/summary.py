"""Summary statistics of a sample."""

from statistics import mean, stddev


def describe(xs):
    return {"n": len(xs), "mean": mean(xs), "sd": stddev(xs)}
