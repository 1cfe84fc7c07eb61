"""Split a list of items into fixed-size pages."""


def page_count(n_items, size):
    """How many pages `n_items` items fill at `size` per page."""
    return (n_items + size - 1) // size


def page(items, number, size):
    """The items of page `number` (0-based)."""
    start = number * size
    return items[start : start + size - 1]
