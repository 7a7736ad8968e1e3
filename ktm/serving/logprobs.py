"""Logprobs of generated tokens, in OpenAI's two shapes (legacy completions, chat).

A logprob is ``log_softmax`` of the model's own next-token logits: the raw distribution, before
temperature and top-p, as vLLM reports by default (``logprobs_mode="raw_logprobs"``). It is
computed only for the rows of a step that asked, after their tokens are chosen, so it changes no
token and costs nothing to the rows that did not ask.

A row's entries wait in a ``Trail`` until the text their tokens produced is released: a streamed
chunk carries the tokens whose text starts in it (a token that only completes a character, or an
end-of-sequence token, goes with the next text or the last chunk). Where a stop string starts
inside a token, that token is kept (part of its text is returned) and the tokens after it are
dropped, so the returned text is a prefix of the tokens' texts joined.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache

import torch

from ktm.decode.text_stream import ContinuationText, decode_continuation

FLOOR = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinity)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the N most likely (id, logprob), most likely first
    offset: int  # characters of the choice's text before this token's text


def step_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int],
                  tops: list[int]) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
    """(B, V) logits, (B,) chosen tokens -> for each of ``rows``: the chosen token's logprob and
    the ``tops[j]`` most likely (id, logprob) of row ``rows[j]``."""
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)
    chosen = lp.gather(1, tokens[idx][:, None])[:, 0].tolist()
    k = max(tops)
    values, ids = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    values, ids = values.tolist(), ids.tolist()
    return {r: (chosen[j], tuple(zip(ids[j][:tops[j]], values[j][:tops[j]])))
            for j, r in enumerate(rows)}


class Trail:
    """One row's logprob entries until the text of their tokens is released. An entry's offset
    is the length of the text of the tokens before it, as ``TextStream`` decodes them
    (``ContinuationText``), without a trailing unfinished character."""

    def __init__(self, tokenizer):
        self.decoded = ContinuationText(tokenizer)
        self.waiting: list[TokenLogprob] = []

    def add(self, token: int, logprob: float, top: tuple[tuple[int, float], ...]) -> None:
        # a token that continues a character starts where that character starts
        offset = len(self.decoded.text().rstrip("\ufffd"))
        self.decoded.append(token)
        self.waiting.append(TokenLogprob(token, logprob, top, offset))

    def take(self, released: int, final: bool, cut: bool) -> list[TokenLogprob]:
        """The entries whose text starts before character ``released`` of the output; at the
        end (``final``) every other one too, unless a stop string ``cut`` the text there."""
        if final and not cut:
            out, self.waiting = self.waiting, []
            return out
        n = 0  # in order: the first entry still held back holds back the ones after it
        while n < len(self.waiting) and self.waiting[n].offset < released:
            n += 1
        out, self.waiting = self.waiting[:n], [] if final else self.waiting[n:]
        return out


def token_text(tokenizer, token: int) -> str:
    """A token's text as it reads inside a text (a continuation, special tokens kept): decoded
    alone, SentencePiece's "▁the" would read "the", and a completion's tokens would join without
    their spaces."""
    return decode_continuation(tokenizer, [token], skip_special_tokens=False,
                               clean_up_tokenization_spaces=False)


def _lp(x: float) -> float:
    """-inf, and NaN (logits gone NaN), -> FLOOR: JSON has neither."""
    return FLOOR if math.isnan(x) else max(x, FLOOR)


def completion_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    """OpenAI's legacy shape, as vLLM fills it: ``top_logprobs`` holds the N most likely tokens
    and the sampled one (N + 1 when it is not among them; N = 0: the sampled one only), most
    likely first. Its keys are texts: of two tokens with one text (two bytes of a character
    both read "\ufffd") it keeps the sampled one, else the more likely."""
    tops = []
    for e in entries:
        top: dict[str, float] = {}
        for t, x in e.top:
            top.setdefault(token_text(tokenizer, t), _lp(x))
        top[token_text(tokenizer, e.token)] = _lp(e.logprob)
        tops.append(dict(sorted(top.items(), key=lambda kv: -kv[1])))
    return {"tokens": [token_text(tokenizer, e.token) for e in entries],
            "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": tops, "text_offset": [e.offset for e in entries]}


@cache
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer, token: int, text: str) -> list[int]:
    """The bytes a token stands for: its text's, or for a token that is part of a character
    (its text reads "\ufffd") the raw byte(s): ``<0xE6>`` (SentencePiece's byte fallback) or
    byte-level BPE's piece mapped back to bytes."""
    if "\ufffd" not in text:
        return list(text.encode("utf-8"))
    piece = tokenizer.convert_ids_to_tokens(token)
    if m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
        return [int(m.group(1), 16)]
    if all(c in _byte_decoder() for c in piece):
        return [_byte_decoder()[c] for c in piece]
    return list(text.encode("utf-8"))


def _chat_entry(tokenizer, token: int, logprob: float) -> dict:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": _lp(logprob), "bytes": token_bytes(tokenizer, token, text)}


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    """OpenAI's chat shape: per token, its logprob and the ``top_logprobs`` most likely."""
    return {"content": [{**_chat_entry(tokenizer, e.token, e.logprob),
                         "top_logprobs": [_chat_entry(tokenizer, t, x) for t, x in e.top]}
                        for e in entries]}
