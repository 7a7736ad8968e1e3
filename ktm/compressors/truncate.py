"""Truncation: each compressed segment cut to its last tokens, read plain (the baseline of a
document longer than the model's window, and of any budget of positions).

``ratio``: the share of a segment's tokens dropped from its start; ``keep``: or at most this
many of its last tokens kept (0: use ``ratio``). The kept tokens are the segment's own ids, so
the LM reads exactly the end of the text it was given.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ktm.compressors.base import Compressor, check_ratio
from ktm.core.prompt import Segment
from ktm.errors import KTMError


class Truncate(Compressor):
    name: ClassVar[str] = "truncate"

    def __init__(self, ratio: float = 0.5, keep: int = 0):
        super().__init__()
        self.ratio = check_ratio(ratio)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise KTMError(f"{self.name} keep must be an integer >= 0 (0: use ratio), got "
                           f"{keep!r}")
        self.keep = keep

    def options(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "keep": self.keep}

    def rewrite(self, texts: list[str], first: list[bool]) -> list[Segment]:
        out = []
        for text, opens in zip(texts, first):
            ids = self.model.tokenize(text, opens)
            n = self.keep if self.keep else len(ids) - round(self.ratio * len(ids))
            kept = ids[max(0, len(ids) - n):]
            out.append(Segment(self.model.tokenizer.decode(kept), ids=tuple(kept)))
        return out
