"""Strip well-known prefixes from identifiers."""


def drop_prefix(name, prefix):
    """`name` without a leading `prefix` (unchanged when it does not start with it)."""
    return name.lstrip(prefix)
