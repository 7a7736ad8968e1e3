"""A chat's history read within a budget of positions (``--history-budget``).

A chat resends its whole history every turn, so an unbounded chat's prefill, KV cache and time
to first token grow with it. With a budget of N positions, a message the client left unmarked
(no ``ktm`` field of its own) is read plain while the whole chat fits in N positions; past
that, the oldest such messages are read merged, whole, at the model's K, oldest first, until it
fits:

    turn 3:   [system][user 1][assistant 1][user 2][assistant 2][user 3]       fits: all plain
    turn 9:   [system][user 1 ~][assistant 1 ~][user 2] ... [user 9]            the oldest merged
    turn 12:  [system][user 1 ~][assistant 1 ~][user 2 ~][assistant 2 ~] ... [user 12]

The policy never merges the system and developer messages (the instructions every turn reads),
the chat template's own text (role tokens) or the newest user message (what is being asked).
Messages the client marked keep its marks and count toward the budget.

The messages merged are always the oldest eligible ones, a block at a time (``block_ends``), and
a longer chat merges at least as many, so turn t's merged messages are the first of turn t+1's:
whole messages merge, nothing straddles a turn, and between the turns where a block is added
each turn's prompt begins with the whole prompt before it, whose KV the server keeps
(``ktm.serving.engine``): the time to first token stays that of reading one turn.

A chat that outgrows even that keeps being served, as a chat front end keeps answering: the
oldest merged messages are read deeper, at the level merging the reader's own merges again
reaches (``ktm.core.encoder.deeper_level``: K=8 for a K=4 reader over inner K=2), a block at a
time, as few as fit; past that the oldest are left out, as truncation does (a block at a time,
never leaving an assistant message first), the rest read deeper. Each step goes only as far as
the chat needs, oldest first:

    [system][user 1 ≈][assistant 1 ≈][user 2 ~] ... [user 30]          the oldest read deeper
    [system][user 9 ≈][assistant 9 ≈] ... [user 40 ~] ... [user 60]    the oldest left out

Only a chat whose newest user message (with the system messages and the template's text) does
not fit alone is refused, naming the numbers. ``HistoryReading`` says what a chat read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from ktm.errors import KTMError
from ktm.serving.protocol import Message, RequestError

# roles whose messages the policy never merges: the instructions every turn reads
KEPT_ROLES = ("system", "developer")
# the merged set grows a block of messages at a time, a block closing once its messages hold
# this share of the budget in tokens: between the turns where it grows (about every
# BLOCK_SHARE * budget / (1.33 * a turn's tokens) turns at K=4), every turn's prompt starts
# with the one before (whose KV is kept); it merges at most this share of the budget more
# than needed
BLOCK_SHARE = 0.5


def check_history_press(history_press: str | None, budget: int | None,
                        press: str | None) -> None:
    """Refuse a history press without a budget to press to, or beside a press of the whole
    prompt (both would press its older part); ``ktm serve`` and ``ktm generate --chat`` alike."""
    if history_press is None:
        return
    if budget is None:
        raise KTMError(f"--history-press {history_press} presses a chat's history to its "
                       "budget: expected --history-budget N too")
    if press is not None:
        raise KTMError(f"--press {press} and --history-press {history_press}: expected one "
                       "(both press the prompt's older part)")


def eligible_messages(roles: Sequence[str], marked: Sequence[bool]) -> list[int]:
    """Indices of the messages the policy may merge, oldest first: not marked by the client,
    not a system or developer message, and not the newest user message."""
    newest_user = max((i for i, r in enumerate(roles) if r == "user"), default=None)
    return [i for i, (role, mark) in enumerate(zip(roles, marked, strict=True))
            if not mark and role not in KEPT_ROLES and i != newest_user]


def block_ends(sizes: Sequence[int], budget: int) -> list[int]:
    """Where the merge blocks of messages of ``sizes`` tokens (oldest first) end (counts of
    messages): a block closes once it holds ``BLOCK_SHARE`` of ``budget`` in tokens; the last
    may be short. Each end depends only on the messages before it, so a longer chat keeps
    every end a shorter one had."""
    step = max(1, int(budget * BLOCK_SHARE))
    ends, held = [], 0
    for i, n in enumerate(sizes, 1):
        held += n
        if held >= step:
            ends.append(i)
            held = 0
    if sizes and (not ends or ends[-1] != len(sizes)):
        ends.append(len(sizes))
    return ends


@dataclass(frozen=True)
class HistoryReading:
    """How a chat was read within its budget: of its older messages (``eligible_messages``,
    oldest first) the first ``dropped`` left out, the next ``deeper`` read at ``level`` (None:
    none read deeper), the next ``merged`` at K, the rest plain; ``positions`` of ``budget``.
    A response's ``ktm.history`` and ``/metrics`` say it."""

    budget: int
    positions: int
    merged: int = 0
    deeper: int = 0
    dropped: int = 0
    level: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class OverBudget(RequestError):
    """Even every older message read as deep as the reader reads them leaves the chat over its
    budget: ``least`` positions. ``candidates`` and ``sizes``: those messages (indices, tokens),
    oldest first, for leaving the oldest out (``ktm.serving.prompts``)."""

    def __init__(self, message: str, least: int):
        super().__init__(message, param="ktm.history_budget")
        self.least = least
        self.candidates: list[int] = []
        self.sizes: list[int] = []


def plan_history(positions: Callable[[int, int], int], sizes: Sequence[int], budget: int,
                 k: int, deep: int | None = None) -> tuple[int, int]:
    """(deeper, merged): how many of the older messages (oldest first, of ``sizes`` tokens) to
    read at the deeper level ``deep``, and how many to read merged, those included; ``positions
    (d, m)`` is the chat's positions with the first d read deeper and the first m (m >= d) merged
    (never more for a larger d or m). The fewest whole blocks (``block_ends``) merged at K that
    bring the chat within ``budget``; where all of them merged do not, the fewest blocks read
    deeper beside the others merged, then the fewest merged beside those. Raises ``OverBudget``
    when every one read deeper (merged, without a deeper level) leaves it over."""
    if budget < 1:
        raise RequestError(f"history budget must be at least 1 position, got {budget}",
                           param="ktm.history_budget")
    n = len(sizes)
    if positions(0, 0) <= budget:
        return 0, 0
    ends = block_ends(sizes, budget)
    if positions(0, n) <= budget:
        return 0, _fewest(ends, lambda m: positions(0, m), budget)
    least = positions(n, n) if deep is not None else positions(0, n)
    if least > budget:
        how = f"read at K={deep}" if deep is not None else f"merged at K={k}"
        raise OverBudget(f"this chat needs {least} positions even with its {n} older "
                         f"message(s) {how} ({positions(0, 0)} read plain), over its history "
                         f"budget of {budget}", least)
    d = _fewest(ends, lambda d: positions(d, n), budget)
    return d, _fewest([e for e in ends if e >= d], lambda m: positions(d, m), budget)


def _fewest(ends: Sequence[int], positions: Callable[[int], int], budget: int) -> int:
    """The first of ``ends`` whose ``positions`` fit ``budget`` (the last one does; fewer
    positions for a later end)."""
    lo, hi = 0, len(ends) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if positions(ends[mid]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return ends[lo]


def drop_ends(sizes: Sequence[int], budget: int, roles: Sequence[str]) -> list[int]:
    """How many of the older messages (of ``sizes`` tokens and ``roles``, oldest first) may be
    left out together: whole blocks (``block_ends``), each taking the assistant messages that
    would otherwise come first after it (a chat goes on from a user message, as truncation
    leaves it)."""
    out: list[int] = []
    for end in block_ends(sizes, budget):
        while end < len(roles) and roles[end] == "assistant":
            end += 1
        if not out or end > out[-1]:
            out.append(end)
    return out


def next_turn(messages: Sequence[Message], answer: str) -> list[Message] | None:
    """A guess at a chat's next request once ``answer`` is given (``--history-ahead``): its
    messages, the answer, and a user message as long as its last (the same message again).
    What the policy merges depends on the next message's length only through the budget, and a
    chat's turns are often alike: where the guess merges as the real turn does, the two share
    every row up to the new message. None for a chat without a user message."""
    users = [m for m in messages if m.role == "user"]
    if not users:
        return None
    return [*messages, Message(role="assistant", content=answer), users[-1]]
