"""How text becomes prompt token ids, the same way for every model family.

A prompt is a list of segments (``ktm.core.prompt``). The first opens with the special tokens the
tokenizer puts *before* a text (a BOS: Llama 3, Gemma; none for SmolLM2), never with those it
puts after one (Llama 2's ``add_eos_token`` would land an EOS mid-prompt, before the plain
question and the answer). Later segments and targets continue the text: where a tokenizer puts
a space before every text it is given (SentencePiece's dummy prefix: Llama 2, Mistral), they are
tokenized after a special token that is then dropped, so ``"Tree: AB" + ", Answer:"`` does not
read ``"Tree: AB , Answer:"``. A tokenizer that puts that space after special tokens too (a
``legacy=True`` Llama tokenizer: ``prepend_scheme="always"``, or a ``Prepend("▁")``
normalizer) has no such token; later segments then go through a copy of its Rust tokenizer
that adds no space before a text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from ktm.errors import KTMError


def lead_ids(tokenizer) -> tuple[int, ...]:
    """The special tokens the tokenizer puts before a text: a BOS for many families (Llama 3,
    Gemma, Mistral), none for SmolLM2. A prompt's first segment opens with them; so do the
    windows pretraining and the readability metric cut from a document's token ids, or a model
    trained always to see a BOS first would read them (and R's no-context baseline) out of
    distribution."""
    probe = "Hello world"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return tuple(full[:i])
    return ()


def check_encodable(texts: Sequence[str]) -> None:
    """Raise naming the first lone surrogate of ``texts`` (what the Rust tokenizer refuses with
    a bare TypeError): half of a UTF-16 pair, or a byte that was not UTF-8 as Python reads one
    in a command-line argument (surrogateescape: U+DC80..U+DCFF)."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            char = text[e.start]
            what = (f"a byte 0x{ord(char) - 0xDC00:02X} that is not UTF-8, as Python reads one "
                    "in a command-line argument" if "\udc80" <= char <= "\udcff"
                    else "half of a UTF-16 pair, not a character")
            raise KTMError(f"text {text[max(e.start - 20, 0):e.end + 20]!r} holds a lone "
                           f"surrogate {char!r} at character {e.start} ({what}): expected "
                           "valid Unicode text") from None


def raw_text_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids (no special tokens added) of raw text: the documents pretraining and the
    readability metric cut windows from. There a special token's string ("<|endoftext|>",
    "<|im_start|>" in a code file) is text like any other, or a window would hold an EOS or a
    chat marker the document never meant. Prompts are not raw text: like HF's and vLLM's, they
    may carry a chat template's markers. A tokenizer that cannot split special tokens
    (mistral-common's refuses the option) is called as it is, and a text in which it still reads
    one is refused, naming it."""
    texts = list(texts)
    check_encodable(texts)
    # a fast tokenizer leaves the option set on its Rust tokenizer: put it back for direct users
    backend = getattr(tokenizer, "backend_tokenizer", None)
    before = getattr(backend, "encode_special_tokens", None)
    try:
        out = tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    except (ValueError, NotImplementedError):
        out = tokenizer(texts, add_special_tokens=False)["input_ids"]
    finally:
        if before is not None:
            backend.encode_special_tokens = before
    # special added tokens too (SmolLM2's "<filename>" is one, not in all_special_ids); an
    # unknown character is read as <unk> whatever the option: not a marker in the text
    special = set(getattr(tokenizer, "all_special_ids", ())) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if getattr(t, "special", False)}
    special.discard(tokenizer.unk_token_id)
    for text, ids in zip(texts, out):
        if not special.isdisjoint(ids):
            token = tokenizer.convert_ids_to_tokens(next(i for i in ids if i in special))
            at = max(text.find(token), 0)
            raise KTMError(f"this tokenizer ({type(tokenizer).__name__}) reads the special token "
                           f"{token!r} in the raw text ...{text[max(at - 30, 0):at + 30]!r}... "
                           "and cannot read it as plain text (it refuses split_special_tokens): "
                           "expected text without it, or a tokenizer that takes the option")
    return out


def continuation_anchor(tokenizer) -> str | None:
    """A special token to tokenize a later segment or a target after, where the tokenizer puts
    a space before every text it is given (SentencePiece's dummy prefix: Llama 2, Mistral): such
    a piece continues the prompt, and that space is not in it (", Answer:" would read " ,
    Answer:"). After a special token the tokenizer starts no new text, so it adds none. None
    where a text tokenizes the same either way (byte-level BPE: SmolLM2, Llama 3, Qwen)."""
    probe = "Hello"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    for token in (tokenizer.unk_token, tokenizer.eos_token, tokenizer.bos_token):
        if token is None:
            continue
        ids = tokenizer(token + probe, add_special_tokens=False)["input_ids"]
        if ids[:1] != [tokenizer.convert_tokens_to_ids(token)]:
            continue
        if ids[1:] == plain:
            return None
        # a token that strips the spaces after it would eat a segment's own leading space
        spaced = tokenizer(f"{token} {probe}", add_special_tokens=False)["input_ids"]
        return token if spaced[1:] != ids[1:] else None
    return None


def _is_prepend(node) -> bool:
    return isinstance(node, dict) and node.get("type") == "Prepend" and (
        node.get("prepend") == "\u2581")


def _drop_dummy_prefix(node) -> bool:
    """Remove, in place, every dummy-prefix step below a serialized normalizer or pre-tokenizer
    (a ``Metaspace`` that prepends its replacement, a ``Prepend("▁")``); whether there was one."""
    changed = False
    if isinstance(node, list):
        kept = [v for v in node if not _is_prepend(v)]
        changed, node[:] = len(kept) != len(node), kept
        for value in node:
            changed |= _drop_dummy_prefix(value)
    elif isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") != "never":
            node["prepend_scheme"], changed = "never", True
        for value in node.values():
            changed |= _drop_dummy_prefix(value)
    return changed


def prefixless_backend(tokenizer):
    """A copy of a fast tokenizer's Rust tokenizer that puts no dummy space before a text, for
    one that puts it even after a special token (so ``continuation_anchor`` finds none). None
    where there is none to remove, or where the copy does not read " Hello" as the original
    reads "Hello" (then it was not a plain dummy space)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # cheap first look: serializing a large vocabulary takes a quarter of a second
    if backend is None or not any(step in f"{backend.normalizer} {backend.pre_tokenizer}"
                                  for step in ("Metaspace", "Prepend")):
        return None
    from tokenizers import Tokenizer

    state = json.loads(backend.to_str())
    changed = _is_prepend(state.get("normalizer"))
    if changed:
        state["normalizer"] = None
    changed |= _drop_dummy_prefix([state.get("normalizer"), state.get("pre_tokenizer")])
    if not changed:
        return None
    copy = Tokenizer.from_str(json.dumps(state))
    plain = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    if (copy.encode("Hello", add_special_tokens=False).ids == plain
            or copy.encode(" Hello", add_special_tokens=False).ids != plain):
        return None
    return copy


class SegmentTokenizer:
    """``tokenize(text, first)``: a prompt segment's or a target's token ids, as above."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lead_ids = lead_ids(tokenizer)
        self.anchor = continuation_anchor(tokenizer)
        self.prefixless = None if self.anchor else prefixless_backend(tokenizer)

    def __call__(self, text: str, first: bool = False) -> list[int]:
        try:
            return self._ids(text, first)
        except TypeError:  # what the Rust tokenizer raises for a lone surrogate
            check_encodable([text])
            raise

    def _ids(self, text: str, first: bool) -> list[int]:
        # never add_special_tokens=True: it would also add what a tokenizer puts after a text
        if first:
            return [*self.lead_ids, *self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        if self.prefixless is not None:
            return self.prefixless.encode(text, add_special_tokens=False).ids
        if self.anchor is None:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(self.anchor + text, add_special_tokens=False)["input_ids"][1:]


@dataclass(frozen=True)
class LineBreaks:
    """The tokens that end a line, read from a vocabulary (``line_break_ids``). ``ids``: every
    token whose text holds a line break, "\\n" or "\\r" (``"\\n"``, ``"\\r\\n"``, ``"\\n    "``,
    a classic Mac "\\r"). Of these, one that holds no "\\n" and ends in "\\r" (``cr_end``) ends
    no line when the next token starts with "\\n" (``lf_start``): a "\\r\\n" written as two
    tokens is one line break, after its "\\n"."""

    ids: frozenset[int]
    cr_end: frozenset[int] = frozenset()
    lf_start: frozenset[int] = frozenset()

    def ends_line(self, ids: list[int], i: int) -> bool:
        """Whether a line ends after ``ids[i]``."""
        return ids[i] in self.ids and not (
            ids[i] in self.cr_end and i + 1 < len(ids) and ids[i + 1] in self.lf_start)


def line_break_ids(tokenizer) -> LineBreaks:
    """The tokenizer's line-break tokens (``LineBreaks``), read from its own decoding, so any
    family's vocabulary works (about 0.5 s for 50k ids). A tokenizer without one (its line
    breaks normalized to spaces or unknown) is an error: a model asked to align lines would
    silently merge across them."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    ids = frozenset(i for i, text in enumerate(texts) if "\n" in text or "\r" in text)
    if not ids:  # its line breaks become spaces or unknown tokens: there are no lines to align
        raise KTMError(f"align_lines: no token of this tokenizer ({type(tokenizer).__name__}, "
                       f"{len(texts)} tokens) holds a line break, so it cannot find a prompt's "
                       "lines; expected a tokenizer that writes '\\n', or align_lines off")
    cr_end = frozenset(i for i in ids if texts[i].endswith("\r") and "\n" not in texts[i])
    return LineBreaks(ids, cr_end, frozenset(i for i in ids if texts[i].startswith("\n")))
