import pytest

from ktm.text_stream import TextStream


class Bytes:
    """A byte-level tokenizer: id = one UTF-8 byte, so characters can span tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def run(text: str, stop=()) -> tuple[list[str], str, bool]:
    ts = TextStream(Bytes(), stop)
    pieces = [ts.push(b) for b in text.encode()]
    pieces.append(ts.flush())
    return [p for p in pieces if p], "".join(pieces), ts.stopped


@pytest.mark.parametrize("text,stop,want,stopped", [
    ("hello world", (), "hello world", False),
    ("hello world. Next", (". ",), "hello world", True),
    ("abc###def", ("##", "c#"), "ab", True),  # the earliest stop string wins
    ("a line\nand more", ("\n\n",), "a line\nand more", False),  # held-back "\n" released later
    ("price: 5€ ok", ("ok",), "price: 5€ ", True),
    ("stop", ("stop",), "", True),
])
def test_stop_strings_cut_the_output_before_them(text, stop, want, stopped):
    _, out, was_stopped = run(text, stop)
    assert out == want and was_stopped == stopped


def test_a_possible_stop_prefix_is_held_back_then_released():
    ts = TextStream(Bytes(), ["END"])
    assert [ts.push(b) for b in b"ab E"] == ["a", "b", " ", ""]  # "E" may start "END"
    assert ts.push(ord("x")) == "Ex"


def test_multibyte_characters_are_never_split():
    pieces, out, _ = run("x€y")
    assert pieces == ["x", "€", "y"] and out == "x€y"
    ts = TextStream(Bytes())
    assert [ts.push(b) for b in "a€".encode()[:3]] == ["a", "", ""]
    assert ts.flush() == "\ufffd"  # an unfinished character at the end is released as decoded


def test_nothing_after_a_stop():
    ts = TextStream(Bytes(), ["!"])
    assert ts.push(ord("a")) == "a" and ts.push(ord("!")) == "" and ts.stopped
    assert ts.push(ord("b")) == "" and ts.flush() == ""
