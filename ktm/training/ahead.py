"""The training loop's next window tokenized while the current step runs.

On a GPU a training step waits on its host. On an H200 at Qwen2.5-0.5B's shape, tokenizing a
window of 8 × 4,096 tokens took 71 to 80 ms of a 0.2 to 0.35 s step, with the GPU idle
meanwhile (``results/bench/h200/0.5b-train-profile.txt``). So ``train``'s loop picks each
step's examples itself, and a worker thread tokenizes them one step ahead. The worker writes
every segment's token ids (``Segment.ids``) and every text target's ids (EOS included,
``target_ids``), and the step then reads ids only. Ids given this way read exactly as the text
they came from (``tests/training/test_ahead.py``).

The worker has a tokenizer of its own, a copy of the model's: a Rust tokenizer used from two
threads at once can fail ("Already borrowed"). The Rust tokenizer releases the GIL while it
encodes, so the worker runs beside the step. A plain thread pool does this; torch's DataLoader
would add worker processes and a collate step for one call per example.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from ktm.core.loss import target_ids
from ktm.core.prompt import as_segments
from ktm.core.tokens import SegmentTokenizer
from ktm.tasks.base import Example


def tokenized(model, example: Example, tokenize: Callable | None = None) -> Example:
    """``example`` with its segments' and text target's token ids written in (what the model
    would make of them); ``tokenize``: in place of ``model.tokenize``."""
    tokenize = tokenize or model.tokenize
    segments = tuple(s if s.ids is not None else replace(s, ids=tuple(tokenize(s.text, i == 0)))
                     for i, s in enumerate(as_segments(example.segments)))
    target = (target_ids(model, example.target, tokenize) if isinstance(example.target, str)
              else example.target)
    return replace(example, segments=segments, target=target)


class Ahead:
    """Each step's window, tokenized on a worker thread while the step before it runs.

    ``take(step, window_at)``: step ``step``'s window (``window_at(step)``, a list of
    examples) tokenized, by the worker if it was handed it at the step before, else now; then
    ``window_at(step + 1)`` is handed to the worker (None: there is none). A worker's error is
    raised by the ``take`` that needs its window."""

    def __init__(self, model):
        self.model = model
        self._tokenize = SegmentTokenizer(copy.deepcopy(model.tokenizer))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ktm-tokenize")
        self._pending: tuple[int, Future] | None = None

    def _window(self, examples: Sequence[Example]) -> list[Example]:
        return [tokenized(self.model, e, self._tokenize) for e in examples]

    def take(self, step: int, window_at: Callable[[int], Sequence[Example] | None]
             ) -> list[Example]:
        pending, self._pending = self._pending, None
        out = (pending[1].result() if pending is not None and pending[0] == step
               else self._window(window_at(step)))
        following = window_at(step + 1)
        if following is not None:
            self._pending = (step + 1, self._pool.submit(self._window, list(following)))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
