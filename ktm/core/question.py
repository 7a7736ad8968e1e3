"""What a prompt asks: the one definition of its question, read by every entry.

A question is read plain, after the document it asks about; the question allocator reads the
document with it in view (``ktm.core.allocate``, ``ktm.core.relevance``), and a question-aware
compressor is given it (``ktm.compressors.base``). Where a prompt says what it asks, that is its
question; where it does not, one rule infers it:

- **marked**: the segments built with ``Segment(text, question=True)`` (the library, tasks,
  ``ktm generate --question``, ``ktm serve``'s ``ktm.question``), as kvpress's pipeline takes
  the question as an argument beside the context;
- **segments, none marked**: the plain segments after the last compressed one;
- **one text** (a chat's newest user message, a completion prompt): its last paragraph when that
  holds at most ``QUESTION_TOKENS`` tokens, else its last line, else its last sentence
  (``split_question``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ktm.core.prompt import Segment

# the end of a text read plain as its question: up to this many tokens
QUESTION_TOKENS = 96


def question_segments(segments: Sequence[Segment]) -> list[int]:
    """The indices of a prompt's question segments: those marked ``question``, else the plain
    segments after the last compressed one (none where the prompt ends compressed)."""
    marked = [i for i, s in enumerate(segments) if s.question]
    if marked:
        return marked
    last = max((i for i, s in enumerate(segments) if s.compress), default=len(segments))
    return list(range(last + 1, len(segments)))


def question_text(segments: Sequence[Segment]) -> str:
    """A prompt's question (``question_segments``) as text."""
    return "".join(segments[i].text for i in question_segments(segments))


def asking(document: str, question: str) -> tuple[Segment, ...]:
    """The prompt that asks ``question`` about ``document``: the document merged, the question
    plain and marked as such."""
    return tuple(s for s in (Segment(document), Segment(question, question=True)) if s.text)


def split_question(model, text: str) -> tuple[str, str, str]:
    """One text as (lead, body, question): the body merged, the lead and the question plain, as
    ``[Segment(lead, compress=False), Segment(body), Segment(question, question=True)]`` reads it
    (``text_prompt``). A text that pastes a document and asks about it then has its question
    read as one, and an instruction before the document stays as written.

    The question is the text's last paragraph when it holds at most ``QUESTION_TOKENS`` tokens,
    else its last line when that does, else its last sentence; the whole text when it is that
    short. The lead is its first line when that is as short and a body remains. A last sentence
    of more than four times as many tokens is no question: the text is then merged whole."""
    body, question = _question_tail(model, text)
    newline = body.find("\n") + 1
    if newline and body[newline:].strip() and (
            len(model.tokenize(body[:newline])) <= QUESTION_TOKENS):
        return body[:newline], body[newline:], question
    return "", body, question


def text_prompt(model, text: str, ratio: float | None = None) -> tuple[Segment, ...]:
    """One text as the prompt ``split_question`` reads: its body merged (at ``ratio``, None:
    the reader's own), its lead plain, its question plain and marked."""
    lead, body, question = split_question(model, text)
    return tuple(s for s in (Segment(lead, compress=False), Segment(body, ratio=ratio),
                             Segment(question, question=True)) if s.text)


def _question_tail(model, text: str) -> tuple[str, str]:
    """(the rest, the question) of ``split_question``."""
    if len(model.tokenize(text)) <= QUESTION_TOKENS:
        return "", text
    body = text.rstrip()
    for start in (body.rfind("\n\n") + 2, body.rfind("\n") + 1):  # a paragraph, a line
        if 0 < start < len(body) and len(model.tokenize(body[start:])) <= QUESTION_TOKENS:
            return text[:start], text[start:]
    line = body.rfind("\n") + 1  # the last line alone is longer: its last sentence
    ends = [m.end() for m in re.finditer(r"[.!?]\s+", body[line:])]
    cut = line + (ends[-1] if ends else 0)
    if len(model.tokenize(body[cut:])) > 4 * QUESTION_TOKENS:
        return text, ""
    return text[:cut], text[cut:]
