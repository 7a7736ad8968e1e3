"""Requests -> prompts as token-id segments (merged or plain), the way the Python API builds them.

A completion prompt is tokenized like ``KTMModel.encode_prompts`` does (the first segment gets the
tokenizer's special tokens), so the server's output for a prompt equals ``model.generate``'s.

Chat messages go through the tokenizer's chat template. To know where each message's content sits
in the rendered text, the template is rendered with a marker as each content and split at the
markers: the template's text becomes plain segments, the contents are put back in their place as
given (merged or plain). Whitespace the template puts before a content (Llama 2's "[INST] ") goes
with the content where the tokenizer reads it with the content's first word, so the chat's ids are
``apply_chat_template``'s (``join_whitespace``). A tokenizer without a template uses
``role: content`` lines and a final ``assistant:``. Everything is tokenized without added special
tokens: the template has its own (the role lines open with the BOS the tokenizer puts before a
text, as a completion does).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from jinja2 import TemplateError
from pydantic import ValidationError

from ktm.core.encoder import deeper_level
from ktm.core.prefix import embedding_rows
from ktm.core.prompt import Segment
from ktm.core.question import split_question, text_prompt
from ktm.decode.press import PressConfig
from ktm.errors import KTMError
from ktm.model import may_leave_out, ratio_refusal, tokens_readable
from ktm.serving.history import (
    HistoryReading,
    OverBudget,
    drop_ends,
    eligible_messages,
    plan_history,
)
from ktm.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    KtmOptions,
    Message,
    RequestError,
)

MARK = "[[ktm-content-{}]]"
MARK_RE = re.compile(r"\[\[ktm-content-(\d+)\]\]")


def _check_joined(given: str | None, parts, where: str) -> None:
    joined = "".join(p.text for p in parts)
    if given not in (None, "", joined):
        raise RequestError(f"{where} must be omitted, empty or exactly the ktm segments' texts "
                           "joined, since the segments already give it", param=where)


def check_ratios(model, req: CompletionRequest | ChatRequest) -> None:
    """Every ratio a request names (``ktm.ratio``, a segment's ``ratio``), checked against the
    loaded reader before any text is read: a 400 naming the field, never a failure of the
    batch the request would join."""
    ext = req.ktm or KtmOptions()
    named = [("ktm.ratio", ext.ratio)]
    named += [(f"ktm.segments.{i}.ratio", s.ratio) for i, s in enumerate(ext.segments or ())]
    for m, msg in enumerate(getattr(req, "messages", ())):
        segments = msg.ktm.segments if msg.ktm is not None else None
        named += [(f"messages.{m}.ktm.segments.{i}.ratio", s.ratio)
                  for i, s in enumerate(segments or ())]
    for param, ratio in named:
        why = None if ratio is None else ratio_refusal(model, ratio)
        if why is not None:
            raise RequestError(f"{param}={ratio:g}: {why}", param=param)


def check_length(model, texts: Sequence[str], param: str, ratio: float | None = None,
                 ids: int = 0) -> None:
    """A prompt of ``texts`` (and ``ids`` token ids given as such) refused, before it is read,
    when it holds more tokens than the model reads within its context at its densest
    (``ktm.model.tokens_readable``; ``ratio``: the one asked for): a cheap count first (a
    token holds at least one byte), the texts tokenized in one batch only where that count
    does not settle it. A 400 naming ``param``; nothing is merged or queued for it."""
    most = tokens_readable(model, ratio)
    if most is None:
        return
    for text in texts:
        _check_text(text, param)
    if ids + sum(len(t.encode("utf-8")) for t in texts) <= most:
        return
    # no texts (a prompt of token ids): nothing to tokenize, its ids are its count
    counted = model.tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
    n = ids + sum(len(x) for x in counted)
    if n > most:
        raise RequestError(f"{param} holds {n} tokens, more than this model reads within its "
                           f"context of {model.max_positions} positions ({most:g} tokens, "
                           f"{most / model.max_positions:g} a position at the most): expected a "
                           "shorter prompt", param=param, code="context_length_exceeded")


def _message_texts(messages: Sequence[Message]) -> list[str]:
    """Each message's text as the chat reads it: its ``ktm.segments``' where it gives them
    (``_read`` checks that they join to its content)."""
    out = []
    for m in messages:
        segments = m.ktm.segments if m.ktm is not None else None
        out += [s.text for s in segments] if segments else [m.text()]
    return out


def completion_segments(model, req: CompletionRequest) -> list[tuple[Segment, ...]]:
    """The request's prompts (one, or each of a list) as segments."""
    check_ratios(model, req)
    ext = req.ktm or KtmOptions()
    prompts = req.prompt_values()
    where = (lambda i: "prompt") if len(prompts) == 1 else (lambda i: f"prompt[{i}]")
    ratios = [r for r in (ext.ratio, *(s.ratio for s in ext.segments or ())) if r is not None]
    ratio = max(ratios, default=None)
    asked = [ext.question] if ext.question else []
    if ext.segments is not None:
        check_length(model, [s.text for s in ext.segments] + asked, "ktm.segments", ratio)
    else:
        for i, p in enumerate(prompts):
            tokens = isinstance(p, tuple)
            check_length(model, asked if tokens else [p, *asked], where(i), ratio,
                         ids=len(p) if tokens else 0)
    if ext.segments is not None:
        if len(prompts) > 1 or isinstance(prompts[0], tuple):
            raise RequestError("ktm.segments gives the one prompt: prompt must be omitted, empty "
                               "or exactly the segments' texts joined, not token ids or a list "
                               f"of {len(prompts)} prompts", param="prompt")
        _check_joined(prompts[0], ext.segments, "prompt")
        return [_asked(model, _text_segments(model, [
            (s.text, s.merge and ext.merge, s.ratio if s.ratio is not None else ext.ratio)
            for s in ext.segments], "prompt"), ext.question)]
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, tuple):
            segs = (Segment("", ext.merge, _in_vocabulary(model, p, where(i)),
                            ratio=ext.ratio if ext.merge else None),)
        elif ext.merge and ext.question is None:  # its own end is its question, as in a chat
            _check_text(p, where(i))
            segs = _text_segments(model, [(s.text, s.compress, s.ratio, s.question)
                                          for s in text_prompt(model, p, ext.ratio)], where(i))
        else:
            segs = _text_segments(model, [(p, ext.merge, ext.ratio)], where(i))
        out.append(_asked(model, _non_empty(segs, where(i)), ext.question))
    return out


def _asked(model, segs: tuple[Segment, ...], question: str | None) -> tuple[Segment, ...]:
    """A completion's segments with its ``ktm.question`` after them, plain and marked."""
    if not question:
        return segs
    return (*segs, Segment(question, question=True,
                           ids=_ids(model, question, False, "ktm.question")))


def _text_segments(model, parts: list[tuple], where: str) -> tuple[Segment, ...]:
    """Segments of (text, merge, ratio[, question]) parts; a ratio reads a merged part at it."""
    parts = [p for p in parts if p[0]]
    return _non_empty(tuple(Segment(t, m, _ids(model, t, i == 0, where),
                                    ratio=r if m else None, question=bool(q and q[0]))
                            for i, (t, m, r, *q) in enumerate(parts)), where)


def _apply(tokenizer, turns: list[tuple[str, int]], pad: str = "") -> str:
    try:
        return tokenizer.apply_chat_template(
            [{"role": role, "content": pad + MARK.format(i) + pad} for role, i in turns],
            tokenize=False, add_generation_prompt=True)
    except TemplateError as e:  # the template's raise_exception: roles it does not take, ...
        raise RequestError(f"this model's chat template refuses these messages (roles "
                           f"{[role for role, _ in turns]}): {e}", param="messages") from e


def render_chat(tokenizer, turns: list[tuple[str, int]]) -> tuple[list[str | int], set[int]]:
    """The chat as template text (str) and message indices (int) where contents go, and the
    messages whose content the template trims (Llama 3's ``| trim``): they are put back trimmed."""
    if not getattr(tokenizer, "chat_template", None):
        out: list[str | int] = []
        for role, i in turns:
            out += [f"{role}: ", i, "\n"]
        return out + ["assistant:"], set()
    rendered = _apply(tokenizer, turns)
    padded = _apply(tokenizer, turns, pad=" \n")
    trimmed = {i for _, i in turns if f" \n{MARK.format(i)} \n" not in padded}
    pieces = MARK_RE.split(rendered)
    out = [int(p) if j % 2 else p for j, p in enumerate(pieces)]
    found = [p for p in out if isinstance(p, int)]
    if found != [i for _, i in turns]:
        raise RequestError("this model's chat template does not place each message's content "
                           f"once and in order (found messages {found}); send a completion with "
                           "ktm.segments instead", param="messages")
    return [p for p in out if p != ""], trimmed


def template_role(tokenizer, role: str) -> str:
    """OpenAI's ``developer`` role (system instructions for newer models) reaches a template
    that never names it, or the role lines without one, as ``system``: the model was trained
    on that, and would read ``<|im_start|>developer`` as an unknown speaker."""
    if role != "developer":
        return role
    template = getattr(tokenizer, "chat_template", None)
    known = isinstance(template, str) and "developer" in template
    return role if known else "system"


def chat_segments(model, req: ChatRequest, history_budget: int | None = None
                  ) -> tuple[Segment, ...]:
    """The request's chat as segments. ``history_budget``: the server's (``--history-budget``;
    the request's ``ktm.history_budget`` overrides it, 0 turning it off): the positions the
    chat is read within, its oldest unmarked messages merged to fit (``ktm.serving.history``)."""
    return chat_reading(model, req, history_budget)[0]


def chat_reading(model, req: ChatRequest, history_budget: int | None = None,
                 history_press: str | None = None
                 ) -> tuple[tuple[Segment, ...], PressConfig | None, HistoryReading | None]:
    """The request's chat as segments, the KV press its history is read with (None: none), and
    how it was read within its budget (None: no budget).

    ``history_press``: the server's (``--history-press``; the request's ``ktm.history_press``
    overrides it, "none" turning it off). A chat over its budget then reads its older messages
    (those the merging policy may merge: ``ktm.serving.history.eligible_messages``) plain, and
    the press drops the share of their KV that brings the chat within the budget
    (``press_to_fit``); the rows before the last of them are pressed with them (kvpress scores
    the prompt's leading rows), the newest user message never. A chat within its budget reads as
    without one."""
    check_ratios(model, req)
    ext_all = req.ktm or KtmOptions()
    check_length(model, _message_texts(req.messages), "messages", ext_all.ratio)
    budget = (history_budget if ext_all.history_budget is None else ext_all.history_budget) or None
    name = history_press if ext_all.history_press is None else ext_all.history_press
    if name == "none" or budget is None or not ext_all.merge:
        name = None
    elif name is not None:
        try:
            PressConfig(name)  # an unknown name is refused whether or not the chat fits
        except KTMError as e:
            raise RequestError(str(e), param="ktm.history_press") from None
    segs, how = _read(model, req.messages, ext_all, budget, pressed=name is not None)
    return segs, None if name is None else press_to_fit(model, segs, budget, name), how


def press_to_fit(model, segs: tuple[Segment, ...], budget: int, name: str
                 ) -> PressConfig | None:
    """The press ``name`` at the least ratio whose kept positions bring ``segs`` within
    ``budget`` (None: they fit already). Raises ``RequestError`` when the rows it may not press
    (after the last pressable segment) already pass the budget, or for a press unknown."""
    from ktm.decode.press import kept_positions

    cp = model.encode_prompts([segs], embed=False)[0]
    if cp.tokens_out <= budget:
        return None
    split = min(cp.pressable, cp.tokens_out - 1)
    room = budget - (cp.tokens_out - split)
    if split < 1 or room < 1:
        raise RequestError(
            f"this chat needs {cp.tokens_out - split} positions outside its older messages (the "
            f"newest user message and what follows the last older one), {cp.tokens_out} in all, "
            f"over its history budget of {budget}: expected a budget of at least "
            f"{cp.tokens_out - split + 1}, or a shorter chat", param="ktm.history_budget")
    try:
        press = PressConfig(name, 1 - room / split)
        while kept_positions(cp, press) > budget:  # float rounding: one position less
            press = PressConfig(name, press.ratio + 0.5 / split)
    except KTMError as e:
        raise RequestError(str(e), param="ktm.history_press") from None
    return press


def chat_prompt(model, messages: Sequence[dict | Message], history_budget: int | None = None,
                merge: bool = True, pressed: bool = False) -> tuple[Segment, ...]:
    """A chat (OpenAI-style messages: ``{"role": ..., "content": ..., "ktm": {...}}``) as the
    prompt ``ktm serve`` reads for it, through the model's chat template: each content merged
    unless its ``ktm`` says ``{"merge": false}``; with ``history_budget`` (positions), unmarked
    contents plain and the oldest merged only as the budget needs (``ktm.serving.history``).
    ``merge`` False: every content plain. ``pressed``: over the budget, the older messages are
    read plain and marked for a KV press instead of merged (``press_to_fit`` then gives the
    press; ``ktm serve --history-press``). Raises ``KTMError`` for a bad message or a chat that
    cannot fit its budget."""
    parsed = []
    for i, m in enumerate(messages):
        try:
            parsed.append(m if isinstance(m, Message) else Message.model_validate(m))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in (i, *first["loc"]))
            raise KTMError(f"bad chat message at {where}: {first['msg']}; expected {{'role': "
                           "'system' | 'developer' | 'user' | 'assistant', 'content': text}"
                           ) from None
    try:
        if not parsed:
            raise RequestError("messages are empty: expected at least one message",
                               param="messages")
        return read_chat(model, parsed, KtmOptions(merge=merge), history_budget, pressed)
    except RequestError as e:
        raise KTMError(str(e)) from None


def read_chat(model, messages: Sequence[Message], ext_all: KtmOptions,
              history_budget: int | None = None, pressed: bool = False) -> tuple[Segment, ...]:
    """``messages`` as segments, read with the request-wide ``ext_all`` and, when merging is
    on, within ``history_budget`` positions (None: no budget). ``pressed``: a chat over the
    budget marks its older messages to be pressed (plain rows, pressable), not merged."""
    return _read(model, messages, ext_all, history_budget, pressed)[0]


def _read(model, messages: Sequence[Message], ext_all: KtmOptions,
          history_budget: int | None = None, pressed: bool = False, leave_out: bool = True
          ) -> tuple[tuple[Segment, ...], HistoryReading | None]:
    """``read_chat``, and how the chat was read within its budget (None: no budget);
    ``leave_out`` False: ``OverBudget`` where it does not fit with every message kept."""
    if ext_all.segments is not None:
        raise RequestError("ktm.segments is for /v1/completions; in a chat, give a message "
                           "\"ktm\": {\"segments\": [...]}", param="ktm.segments")
    if ext_all.question:
        raise RequestError("ktm.question is for /v1/completions; in a chat, the newest user "
                           "message's end is its question (\"\": none, the message merged whole)",
                           param="ktm.question")
    merge_all = ext_all.merge
    # with a budget, an unmarked message is read plain unless the budget needs it merged
    budgeted = history_budget is not None and merge_all
    contents: list[list[tuple[str, bool]]] = []
    marked: list[bool] = []
    for i, m in enumerate(messages):
        ext = m.ktm
        marked.append(ext is not None and (ext.merge is not None or ext.segments is not None))
        if ext is not None and ext.segments is not None:
            _check_joined(m.text(), ext.segments, f"messages.{i}.content")
            parts = [(s.text, s.merge) for s in ext.segments]
        else:
            unmarked = not budgeted
            parts = [(m.text(), unmarked if ext is None or ext.merge is None else ext.merge)]
        contents.append([(t, merge and merge_all) for t, merge in parts if t])
    last, asked = messages[-1], False
    if (merge_all and not budgeted and not marked[-1] and last.role == "user"
            and ext_all.question is None
            and len(contents[-1]) == 1):
        # the newest user message holds the question: its end read plain (``split_question``)
        _check_text(contents[-1][0][0], "messages")
        lead, body, question = split_question(model, contents[-1][0][0])
        contents[-1] = [(t, merge) for t, merge in ((lead, False), (body, True),
                                                    (question, False)) if t]
        asked = bool(question)
    if not any(contents):
        raise RequestError("messages are empty: expected at least one message with content",
                           param="messages")
    layout, trimmed = render_chat(model.tokenizer, [(template_role(model.tokenizer, m.role), i)
                                                    for i, m in enumerate(messages)])
    for i in trimmed:
        contents[i] = _strip(contents[i])
    if not budgeted:  # a budget may leave messages out to fit: the count is its own then
        check_template_room(model, layout, sum(1 for c in contents if c))
    # a template writes its own BOS; the role lines that stand in for a missing one open with
    # the tokenizer's, as a completion does (a model with a BOS has never read text without it)
    lead = not getattr(model.tokenizer, "chat_template", None)
    read = TemplateReader(model)
    segs: list[Segment] = []
    owners: list[int | None] = []
    for text, merge, owner in join_whitespace(model, layout, contents):
        _check_text(text, "messages")
        ids = model.tokenize(text, first=not segs) if lead else read(text)
        segs.append(Segment(text, merge, tuple(ids), ratio=ext_all.ratio if merge else None))
        owners.append(owner)
    if asked:  # the question split off the newest user message: marked as such
        j = max(j for j, owner in enumerate(owners) if owner == len(messages) - 1)
        segs[j] = replace(segs[j], question=True)
    how = None
    if budgeted:
        try:
            segs, how = _within_budget(model, segs, owners, messages, marked, history_budget,
                                       ext_all.ratio, pressed)
        except OverBudget as e:
            if not leave_out:
                raise
            return _leave_out(model, messages, ext_all, history_budget, e)
    return _non_empty(tuple(segs), "messages"), how


def least_positions(model, layout: list[str | int], contents: int) -> int:
    """The fewest positions a chat of ``layout`` (``render_chat``'s) and ``contents`` non-empty
    contents can take (``check_template_room``)."""
    read: dict[tuple[bool, str], int] = {}
    least = 0 if may_leave_out(model) else contents
    for j, piece in enumerate(layout):
        if not isinstance(piece, str):
            continue
        key = (j == 0, piece)  # the chat's start, or after a content's text
        if key not in read:
            reader = TemplateReader(model)
            reader.after = "" if j == 0 else None
            read[key] = len(reader(piece))
        least += read[key] - (len(piece) - len(piece.strip()))
    return least


def check_template_room(model, layout: list[str | int], contents: int) -> None:
    """A chat refused before its pieces are read one by one (the costly part of reading a chat
    of thousands of messages) where the least it can take already passes the model's context:
    its template's text, always read plain, as ``TemplateReader`` reads each distinct piece
    (once), less the whitespace at the pieces' edges (which ``join_whitespace`` may move into a
    content), and a position for each of its ``contents`` non-empty contents (none where the
    model's allocator may leave text out)."""
    context = model.max_positions
    if context is None or not getattr(model.tokenizer, "chat_template", None):
        return
    least = least_positions(model, layout, contents)
    if least > context:
        raise RequestError(f"this chat takes at least {least} positions (its template's text, "
                           f"read plain, and its {contents} messages' contents): more than the "
                           f"model's context of {context} positions; expected fewer messages (or "
                           "ktm.history_budget, which leaves the oldest out)", param="messages",
                           code="context_length_exceeded")


def _leave_out(model, messages: Sequence[Message], ext_all: KtmOptions, budget: int,
               over: OverBudget) -> tuple[tuple[Segment, ...], HistoryReading]:
    """The chat with its oldest older messages left out, as truncation leaves a chat: the
    fewest whole blocks (``drop_ends``) after which the rest, read as the policy reads them,
    fit. A 400 naming the numbers when even leaving out every one does not: its newest user
    message, with the system messages and the template's text, is over the budget alone."""
    roles = [messages[i].role for i in over.candidates]
    ends = drop_ends(over.sizes, budget, roles)
    tried: dict[int, tuple | OverBudget] = {}

    def attempt(n: int) -> bool:
        gone = set(over.candidates[:n])
        try:
            segs, how = _read(model, [m for i, m in enumerate(messages) if i not in gone],
                              ext_all, budget, leave_out=False)
            tried[n] = segs, replace(how, dropped=n)
        except OverBudget as e:
            tried[n] = e
        return not isinstance(tried[n], OverBudget)

    if not ends or not attempt(ends[-1]):
        least = tried[ends[-1]].least if ends else over.least
        raise RequestError(
            f"this chat needs {least} positions with every one of its {len(over.candidates)} "
            f"older message(s) left out, over its history budget of {budget}: expected a "
            f"budget of at least {least}, or a shorter newest message (the system messages, "
            "the newest user message and the template's text are always read)",
            param="ktm.history_budget")
    lo, hi = 0, len(ends) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if attempt(ends[mid]):
            hi = mid
        else:
            lo = mid + 1
    return tried[ends[lo]]


def _within_budget(model, segs: list[Segment], owners: list[int | None],
                   messages: Sequence[Message], marked: list[bool], budget: int,
                   ratio: float | None, pressed: bool = False
                   ) -> tuple[list[Segment], HistoryReading]:
    """``segs`` with the oldest eligible messages' segments merged, as few as fit ``budget``,
    the oldest of those read deeper where merging all does not fit (``plan_history``), and how;
    ``pressed``: over the budget, every eligible message's segments pressable and plain
    (``Segment(ratio=1)``: one token per position), for a press to fit. Raises ``OverBudget``
    where every one read deeper leaves it over."""
    candidates = [i for i in eligible_messages([m.role for m in messages], marked)
                  if i in owners]
    sizes = [sum(len(s.ids) for s, o in zip(segs, owners) if o == i) for i in candidates]
    deep = deeper_level(model.encoder)
    level = None if deep is None else deep[0]

    def merged(d: int, n: int, at: float | None = ratio) -> list[Segment]:
        deeper, chosen = set(candidates[:d]), set(candidates[:n])
        return [replace(s, compress=True, ratio=level if o in deeper else at)
                if o in chosen else s for s, o in zip(segs, owners, strict=True)]

    def positions(d: int, n: int) -> int:
        return model.encode_prompts([tuple(merged(d, n))], embed=False)[0].tokens_out

    if pressed:
        n = 0 if positions(0, 0) <= budget else len(candidates)
        return merged(0, n, 1.0), HistoryReading(budget, positions(0, 0))
    try:
        d, n = plan_history(positions, sizes, budget, model.k, level)
    except OverBudget as e:
        e.candidates, e.sizes = candidates, sizes
        raise
    return merged(d, n), HistoryReading(budget, positions(d, n), merged=n - d, deeper=d,
                                        level=level if d else None)


def join_whitespace(model, layout: list[str | int], contents: list[list[tuple[str, bool]]]
                    ) -> list[tuple[str, bool, int | None]]:
    """The chat's pieces as (text, merge, the message it holds: None for template text), in
    order. Where a piece of the template ends in
    whitespace the next content's first word takes in (Llama 2's "[INST] " + "Hello": the
    tokenizer reads "▁Hello", as ``apply_chat_template`` and vLLM give, not "▁", "Hello"), that
    whitespace moves to the start of the content, merged or not; the same at a content's end
    before template text. Only as much moves as the tokenizer reads with the next word (ChatML's
    "user\n" + "Hello" stays as it is), so the pieces read as the whole text reads. The
    boundaries between a message's own ``ktm.segments`` are the client's and stay."""
    pieces: list[list] = []  # [text, merge, from the template, message]
    for piece in layout:
        if isinstance(piece, int):
            pieces += [[text, merge, False, piece] for text, merge in contents[piece]]
        elif pieces and pieces[-1][2]:  # an empty content: the template's texts meet
            pieces[-1][0] += piece
        else:
            pieces.append([piece, False, True, None])
    for a, b in zip(pieces, pieces[1:]):
        if a[2] or b[2]:
            moved = _joined_tail(model, a[0], b[0])
            a[0], b[0] = a[0][:len(a[0]) - len(moved)], moved + b[0]
    return [(text, merge, owner) for text, merge, _, owner in pieces if text]


def _joined_tail(model, text: str, after: str, probe: int = 32) -> str:
    """The shortest tail of ``text``'s trailing whitespace such that ``text`` without it and
    ``after`` with it read as ``text + after`` reads (empty where they already do)."""
    space = text[len(text.rstrip()):]
    head = after[:probe]
    if not space or not head:
        return ""
    whole = model.tokenize(space + head)
    for n in range(len(space) + 1):
        if model.tokenize(space[:len(space) - n]) + model.tokenize(space[len(space) - n:] + head
                                                                    ) == whole:
            return space[len(space) - n:]
    return space


class TemplateReader:
    """The pieces of a rendered chat, one after another, read as the tokenizer reads them in
    the whole rendered text (HF's ``apply_chat_template``, vLLM): the chat's first text as any
    text, text after a special or added token (``<s>``, ``[INST]``) as it reads text there (a
    legacy SentencePiece tokenizer puts its dummy space before it: "<s>", "▁[INST]", as Meta's
    Llama 2 chat format has it), text after other text as a continuation (``ktm.core.tokens``)."""

    def __init__(self, model):
        self.model, self.tokenizer = model, model.tokenizer
        self.specials = [t for t in getattr(self.tokenizer, "added_tokens_encoder", {}) if t]
        self.after: str | None = ""  # "": the chat's start; a token: right after it; None: text

    def __call__(self, text: str) -> list[int]:
        found = [i for i in (text.find(t) for t in self.specials) if i >= 0]
        cut = 0 if self.after is not None else min(found, default=len(text))
        ids = self.model.tokenize(text[:cut]) if cut else []
        if text[cut:]:
            anchor = self.after or ""  # read the text after the token it follows
            ids += self.tokenizer(anchor + text[cut:], add_special_tokens=False
                                  )["input_ids"][1 if anchor else 0:]
        self.after = next((t for t in self.specials if text.endswith(t)), None)
        return ids


def _strip(parts: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """A content's parts with the whitespace around the whole content removed."""
    parts = list(parts)
    while parts and not parts[0][0].strip():
        parts.pop(0)
    while parts and not parts[-1][0].strip():
        parts.pop()
    if parts:
        parts[0] = (parts[0][0].lstrip(), parts[0][1])
        parts[-1] = (parts[-1][0].rstrip(), parts[-1][1])
    return parts


def _ids(model, text: str, first: bool, param: str) -> tuple[int, ...]:
    _check_text(text, param)
    return tuple(model.tokenize(text, first=first))


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON may escape a lone surrogate ("\\ud800")
        raise RequestError(f"{param} is not valid Unicode: {text[e.start:e.end]!r} at character "
                           f"{e.start} is a lone surrogate; expected text", param=param) from e


def _in_vocabulary(model, ids: tuple[int, ...], where: str) -> tuple[int, ...]:
    """Token ids as given (no special tokens added), each a row of the model's embedding."""
    rows = embedding_rows(model.input_embedding)
    bad = next((i for i in ids if not 0 <= i < rows), None)
    if bad is not None:
        raise RequestError(f"{where} token id {bad} is outside this model's vocabulary: "
                           f"expected ids in [0, {rows})", param="prompt")
    return ids


def _non_empty(segs: tuple[Segment, ...], param: str) -> tuple[Segment, ...]:
    segs = tuple(s for s in segs if s.ids)
    if not segs:
        raise RequestError(f"{param} is empty: expected text to complete", param=param)
    return segs


def context_of(segs: tuple[Segment, ...]) -> tuple[Segment, ...]:
    """The leading segments the server may keep the KV of: those before the prompt's marked
    question (``Segment.question``: the document it asks about, merged or plain), else up to
    the last merged one (a long document merged, then a plain question that changes from
    request to request)."""
    asked = next((i for i, s in enumerate(segs) if s.question), None)
    if asked is not None:
        return segs[:asked]
    last = max((i for i, s in enumerate(segs) if s.compress), default=-1)
    return segs[:last + 1]