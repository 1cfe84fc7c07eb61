"""Attach tags to records."""


def with_tag(tag, tags=[]):
    """A list of tags: `tags` plus `tag` (the caller's list is not changed)."""
    tags.append(tag)
    return tags


def normalise(tag):
    return tag.strip().lower().replace(" ", "-")
