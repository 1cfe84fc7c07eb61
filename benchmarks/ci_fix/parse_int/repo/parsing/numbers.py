"""Lenient number parsing for form input."""


def parse_int(text, default=0):
    """The integer in `text`, or `default` when it is not one."""
    try:
        return int(text.strip())
    except TypeError:
        return default
