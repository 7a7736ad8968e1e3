"""The torch runtime's options on an engine of its own: the defaults taken, the rest refused by
name, and no press or merged answer ever."""

import pytest

from ktm.errors import KTMError
from ktm.util.own_engine import OwnEngine


class Engine(OwnEngine):
    name = "llamacpp"


def test_the_defaults_are_taken_and_read_as_what_runs():
    engine = Engine()
    engine.compile, engine.weights = "auto", "native"
    engine.compile = "off"
    engine.use_press(None)
    assert (engine.compile, engine.compiles, engine.weights) == ("off", 0, "native")
    assert (engine.presses, engine.press, engine.merges) == (False, None, False)


@pytest.mark.parametrize("name,value,match", [
    ("compile", "on", "compile='on' is an option of the torch backend, not llamacpp"),
    ("weights", "int8", "weights='int8' is an option of the torch backend, not llamacpp"),
])
def test_another_setting_is_refused_by_name(name, value, match):
    with pytest.raises(KTMError, match=match):
        setattr(Engine(), name, value)


def test_a_press_or_a_merged_answer_is_refused():
    class Press:
        name = "knorm"

    with pytest.raises(KTMError, match="press 'knorm' cannot reach the KV cache of the llamacpp"):
        Engine().use_press(Press())
    with pytest.raises(KTMError, match="merge_window=8: the llamacpp backend merges no answer"):
        Engine().merge_due(8, 9)
