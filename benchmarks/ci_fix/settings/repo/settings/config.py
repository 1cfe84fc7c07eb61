"""Read typed values from a settings mapping."""

DEFAULT_PORT = 8080


def port(cfg):
    """The port as an int; DEFAULT_PORT when the setting is absent."""
    value = cfg.get("port")
    return int(value)


def debug(cfg):
    return str(cfg.get("debug", "false")).lower() in ("1", "true", "yes")
