"""Stock levels by product."""


def drop_empty(levels):
    """Remove products with no stock (in place) and return the dict."""
    for name in levels:
        if levels[name] == 0:
            del levels[name]
    return levels


def total(levels):
    return sum(levels.values())
