from settings.config import DEFAULT_PORT, debug, port


def test_port_given():
    assert port({"port": "9000"}) == 9000


def test_port_missing():
    assert port({}) == DEFAULT_PORT


def test_debug():
    assert debug({"debug": "Yes"}) and not debug({})
