"""Angles of vectors in the plane."""

import math


def angle_deg(x, y):
    """The angle of (x, y) from the positive x axis, in degrees in (-180, 180]."""
    return math.degrees(math.atan2(x, y))
