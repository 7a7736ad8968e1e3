"""Token ids -> text pieces as they are decoded, with OpenAI-style stop strings.

Generated ids continue a text, so they are decoded as a continuation (``decode_continuation``):
after an anchor token, whose text is then cut off. Decoded alone, SentencePiece's decoder (Llama 2,
Mistral) strips the space of the first piece ("▁Paris" would read "Paris" after "... is"); in
context it reads " Paris", as ``decode(prompt + generated)`` and vLLM give. Byte-level BPE
(SmolLM2, GPT-2) decodes the same either way.

A piece is released only when it is final: text ending inside a multi-byte character is held
back, and so is a run of byte-fallback tokens still open (``byte_fallback_ids``), and a tail that
could still grow into a stop string. The output stops before the first stop string, which is not
included.

Each push decodes only the ids after the last settled point (``ContinuationText``, which the
logprob offsets of ``ktm.serving.logprobs`` read too): a point after a token that is neither a
byte-fallback nor a special token and whose text ends in a whole character, which no later token
changes. A long generation then costs linear time, not quadratic.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from weakref import WeakKeyDictionary

_ANCHORS: WeakKeyDictionary = WeakKeyDictionary()  # tokenizer -> its anchor ids


def byte_fallback_ids(tokenizer) -> frozenset[int]:
    """Ids of SentencePiece's byte-fallback tokens (``<0xE6>``: Llama 2, Mistral). Their decoder
    rewrites a run of them as a whole once it ends, and an invalid run becomes one U+FFFD per
    byte, the valid bytes before its bad one included: a newline already released could vanish
    from the final text. Empty for byte-level BPE, whose decoder replaces only the bad bytes."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is None:
        return frozenset()
    ids = convert([f"<0x{b:02X}>" for b in range(256)])
    return frozenset(i for i in ids if i is not None and i != tokenizer.unk_token_id)


def anchor_ids(tokenizer) -> list[int]:
    """A token to decode a continuation after: "a", else the first plain ASCII word of the
    vocabulary; never a byte-fallback or special token (a byte run after it would take it in).
    Empty for a tokenizer that cannot encode. Found once per tokenizer (the search may read the
    whole vocabulary); a tokenizer that cannot be a weak dictionary key is searched each time."""
    try:
        return list(_ANCHORS[tokenizer])
    except (KeyError, TypeError):  # TypeError: unhashable
        pass
    ids = _find_anchor(tokenizer)
    try:
        _ANCHORS[tokenizer] = tuple(ids)
    except TypeError:  # unhashable or not weakly referable
        pass
    return ids


def _find_anchor(tokenizer) -> list[int]:
    if not hasattr(tokenizer, "encode"):
        return []
    skip = byte_fallback_ids(tokenizer) | frozenset(getattr(tokenizer, "all_special_ids", ()))
    for i in chain(tokenizer.encode("a", add_special_tokens=False)[-1:], range(len(tokenizer))):
        if i not in skip and (text := tokenizer.decode([i])).isascii() and text.isalnum():
            return [i]
    return []


def decode_continuation(tokenizer, ids: Sequence[int], anchor: Sequence[int] | None = None,
                        **kwargs) -> str:
    """The text ``ids`` add to a text they continue: decoded after ``anchor`` (default
    ``anchor_ids(tokenizer)``), special tokens skipped; ``kwargs`` go to ``decode``."""
    anchor = anchor_ids(tokenizer) if anchor is None else list(anchor)
    kwargs.setdefault("skip_special_tokens", True)
    if anchor:
        head = tokenizer.decode(anchor, **kwargs)
        both = tokenizer.decode(anchor + list(ids), **kwargs)
        if head and both.startswith(head):
            return both[len(head):]
    return tokenizer.decode(list(ids), **kwargs)


class ContinuationText:
    """The text of generated ids, decoded as a continuation (``decode_continuation``) one id at a
    time, decoding again only the ids after the last settled point: after a token that is
    neither a byte-fallback nor a special token (a byte run merges across those) and whose text
    ends in a whole character, which no later token changes. Nothing settles when ``decode``
    cleans up spaces, which reads across tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.anchor = anchor_ids(tokenizer)
        self.byte_ids = byte_fallback_ids(tokenizer)
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self.settles = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.settled = ""  # the text of the ids before ``ids``, which no later token changes
        self.ids: list[int] = []  # the ids after the last settled point

    def append(self, token: int) -> None:
        self.ids.append(token)

    def text(self) -> str:
        """The text of every id so far; it ends in U+FFFD while a character is unfinished."""
        tail = decode_continuation(self.tokenizer, self.ids, self.anchor)
        text = self.settled + tail
        last = self.ids[-1] if self.ids else None
        if (self.settles and last is not None and last not in self.byte_ids
                and last not in self.special and not tail.endswith("\ufffd")):
            self.settled, self.ids = text, []
        return text


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.decoded = ContinuationText(tokenizer)
        self.open_run = False
        self.stop = tuple(s for s in stop if s)
        self.text = ""  # decoded text of all ids, up to the last complete character
        self.sent = 0  # characters of ``text`` released so far
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token id; returns the newly released text (often empty)."""
        if self.stopped:
            return ""
        self.decoded.append(token)
        # decoding skips special tokens: one between two bytes does not end their run
        self.open_run = token in self.decoded.byte_ids or (
            self.open_run and token in self.decoded.special)
        if self.open_run:  # its text is not final yet
            return ""
        text = self.decoded.text()
        if text.endswith("\ufffd"):  # ends inside a multi-byte character
            return ""
        return self._update(text, final=False)

    def flush(self) -> str:
        """Everything held back (a tail that never became a stop string or a whole character,
        a byte run never closed), up to a stop string in it: the output is over."""
        if self.stopped:
            return ""
        return self._update(self.decoded.text(), final=True)

    def _update(self, text: str, final: bool) -> str:
        self.text = text
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(min(hits))
        return self._release(len(text) if final else len(text) - self._partial_stop(text))

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:end], end
        return piece
