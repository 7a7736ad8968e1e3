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

The messages merged are always the oldest eligible ones, and a longer chat merges at least as
many, so turn t's merged messages are the first of turn t+1's: whole messages merge, nothing
straddles a turn, and the KV of a merged prefix read once stays valid for the turns after.
A chat that cannot fit even with every eligible message merged is refused, naming the numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ktm.serving.protocol import RequestError

# roles whose messages the policy never merges: the instructions every turn reads
KEPT_ROLES = ("system", "developer")


def eligible_messages(roles: Sequence[str], marked: Sequence[bool]) -> list[int]:
    """Indices of the messages the policy may merge, oldest first: not marked by the client,
    not a system or developer message, and not the newest user message."""
    newest_user = max((i for i, r in enumerate(roles) if r == "user"), default=None)
    return [i for i, (role, mark) in enumerate(zip(roles, marked, strict=True))
            if not mark and role not in KEPT_ROLES and i != newest_user]


def plan_history(positions: Callable[[int], int], candidates: Sequence[int], budget: int,
                 k: int) -> int:
    """How many of ``candidates`` (oldest first) to merge: the fewest that bring the chat within
    ``budget`` positions, ``positions(n)`` being the chat's positions with the first n merged
    (never more for a larger n). Raises ``RequestError`` when even all of them leave it over."""
    if budget < 1:
        raise RequestError(f"history budget must be at least 1 position, got {budget}",
                           param="ktm.history_budget")
    if positions(0) <= budget:
        return 0
    least = positions(len(candidates))
    if least > budget:
        raise RequestError(
            f"this chat needs {least} positions even with its {len(candidates)} older "
            f"message(s) merged at K={k} ({positions(0)} read plain), over its history budget "
            f"of {budget}: expected a budget of at least {least}, or a shorter chat (the system "
            "messages and the newest user message are always read plain)",
            param="ktm.history_budget")
    lo, hi = 1, len(candidates)  # positions(hi) fits, positions(lo - 1) does not
    while lo < hi:
        mid = (lo + hi) // 2
        if positions(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo
