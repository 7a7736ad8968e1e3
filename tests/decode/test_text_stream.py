import pytest
from helpers import byte_fallback_tokenizer

from ktm.decode.text_stream import TextStream, anchor_ids, byte_fallback_ids, decode_continuation


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


def in_context(tok, ids, before=(257,)) -> str:
    """What ``ids`` add to a text that ends in ``before``: the reference of a continuation."""
    head = tok.decode(list(before), skip_special_tokens=True)
    return tok.decode([*before, *ids], skip_special_tokens=True)[len(head):]


def test_byte_fallback_pieces_join_to_the_whole_decoding():
    """The decoder turns an invalid byte run into one U+FFFD per byte, the valid bytes before the
    bad one included: a newline byte released at once was no longer in the final text ("ok\\n�
    ok" streamed, "ok�� ok" generated). A run is released when a non-byte token closes it (a
    special token does not: decoding skips it)."""
    import random

    tok = byte_fallback_tokenizer()
    ok, byte = 257, [1 + b for b in range(256)]
    for ids in ([ok, byte[0x0A], byte[0xE6], ok], [ok, *(byte[b] for b in "\n東".encode()), ok],
                [ok, byte[0x6C], byte[0xFF]]):
        ts = TextStream(tok)
        pieces = [ts.push(i) for i in ids]
        assert "".join(pieces) + ts.flush() == in_context(tok, ids)
    assert pieces == [" ok", "", ""]  # an open run is held back
    ts = TextStream(tok)
    assert [ts.push(i) for i in (ok, *(byte[b] for b in "東".encode()), ok)] == [
        " ok", "", "", "", "東 ok"]  # never a broken character mid-stream
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice([ok, 0, *rng.sample(byte, 3)]) for _ in range(10)]  # 0: <unk>
        ts = TextStream(tok)
        assert "".join(ts.push(i) for i in ids) + ts.flush() == in_context(tok, ids)


def test_a_stop_string_in_text_held_back_to_the_end_still_stops():
    """A byte run still open when the output ends (Llama 2 writes "\\n" as <0x0A>; the EOS after
    it is skipped, so it does not close the run) was flushed whole, stop string and all; the
    engine then called a stop a length limit."""
    from types import SimpleNamespace

    from ktm.serving.engine import Job, Row

    tok = byte_fallback_tokenizer()
    ok, newline = 257, 1 + 0x0A
    ts = TextStream(tok, ["\n"])
    assert [ts.push(ok), ts.push(newline), ts.push(ok), ts.flush()] == [" ok", "", "", ""]
    assert ts.stopped
    ts = TextStream(tok, ["\n"])
    assert [ts.push(ok), ts.push(newline), ts.flush()] == [" ok", "", ""] and ts.stopped
    model = SimpleNamespace(tokenizer=tok, eos_ids=frozenset(), device="cpu")
    cp = SimpleNamespace(tokens_in=1, tokens_out=1)
    row = Row(Job((), 2, lambda e: None, stop=("\n",)), model, cp, 0, limit=2)
    assert row.push(ok).text == " ok"
    end = row.push(newline)
    assert (end.text, end.finish) == ("", "stop")


class WholeText(TextStream):
    """The reference: every push decodes all the ids so far (the stream before it settled)."""

    def __init__(self, tokenizer, stop=()):
        super().__init__(tokenizer, stop)
        self.tokenizer, self.anchor = tokenizer, anchor_ids(tokenizer)
        self.byte_ids = byte_fallback_ids(tokenizer)
        self.skipped = frozenset(getattr(tokenizer, "all_special_ids", ()))

    def push(self, token):
        if self.stopped:
            return ""
        self.all = [*getattr(self, "all", []), token]
        self.open_run = token in self.byte_ids or (self.open_run and token in self.skipped)
        if self.open_run:
            return ""
        text = decode_continuation(self.tokenizer, self.all, self.anchor)
        return "" if text.endswith("\ufffd") else self._update(text, final=False)

    def flush(self):
        if self.stopped:
            return ""
        text = decode_continuation(self.tokenizer, getattr(self, "all", []), self.anchor)
        return self._update(text, final=True)


def stream_tokenizers():
    from helpers import build_tokenizer, legacy_sentencepiece_tokenizers

    return {"byte-level": build_tokenizer(bos=True), "byte-fallback": byte_fallback_tokenizer(),
            "sentencepiece": legacy_sentencepiece_tokenizers()["legacy"]}


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback", "sentencepiece"])
def test_streaming_only_the_unsettled_tail_gives_what_decoding_everything_gives(kind):
    """Long random id sequences (bytes, special tokens, unknowns, broken characters) with stop
    strings taken from their own text: the same pieces, the same stop."""
    import random

    tok = stream_tokenizers()[kind]
    rng = random.Random(0)
    vocab = list(range(len(tok)))
    specials = list(tok.all_special_ids)
    words = sorted(set(vocab) - byte_fallback_ids(tok) - set(specials))  # close byte runs
    for trial in range(12):
        ids = [rng.choice(specials) if r < 0.05 else rng.choice(words if r < 0.4 else vocab)
               for r in (rng.random() for _ in range(300))]
        whole = decode_continuation(tok, ids)
        at = rng.randrange(len(whole))
        stop = (whole[at:at + rng.randint(1, 4)], "\n\n") if trial % 3 else ()
        new, ref = TextStream(tok, stop), WholeText(tok, stop)
        assert [new.push(i) for i in ids] == [ref.push(i) for i in ids]
        assert (new.flush(), new.stopped) == (ref.flush(), ref.stopped)


def test_each_push_decodes_only_the_ids_after_the_last_settled_point():
    """Decoding every generated id on every token was quadratic over a long generation."""
    tok = stream_tokenizers()["byte-level"]
    ids = tok("The quick brown fox jumps over the lazy dog.", add_special_tokens=False
              )["input_ids"] * 50
    want = decode_continuation(tok, ids)
    decoded: list[int] = []
    plain = tok.decode
    tok.decode = lambda ids, **kw: (decoded.append(len(ids)), plain(ids, **kw))[1]
    ts = TextStream(tok)
    assert "".join(ts.push(i) for i in ids) + ts.flush() == want
    assert max(decoded) <= 3  # the anchor and a token or two, not 500 ids


def test_the_anchor_is_found_once_per_tokenizer():
    """``anchor_ids`` may read the whole vocabulary (no usable "a"); every TextStream and every
    logprob entry's ``token_text`` asked again."""
    from ktm.serving.logprobs import token_text

    tok = stream_tokenizers()["byte-level"]
    calls = []
    plain = tok.encode
    tok.encode = lambda *a, **kw: (calls.append(a), plain(*a, **kw))[1]
    first = anchor_ids(tok)
    for _ in range(5):
        TextStream(tok)
        token_text(tok, 10)
    assert anchor_ids(tok) == first and len(calls) == 1
    assert anchor_ids(Bytes()) == []  # no encode: nothing to find, nothing kept
