"""Variable tracking (RULER's): a chain of assignments spread through a long document, and a
question asking which names hold its value.

    ... QXMPL = 48213 ... ZRTAB = QXMPL ... KWOFE = ZRTAB ...
    "\\nQuestion: which variables hold the value 48213? Answer: The variables holding 48213
     are" -> " QXMPL, ZRTAB, KWOFE."

``hops`` assignments make a chain, the first giving the value, each next one the name before
it; ``chains`` chains of distinct values are inserted, one asked about (the others
distract). The lines go at depths drawn at random, each chain's in its order. A hit names every
variable of the asked chain. Documents and tokens as ``ktm.tasks.needle``'s.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field

from ktm.errors import KTMError
from ktm.tasks import haystack
from ktm.tasks.base import Example, PromptMode, TaskKind, qa_prompt
from ktm.tasks.questions import QuestionTask


@dataclass
class VarTrackTask(QuestionTask):
    """Which names hold a value, through a chain of assignments (module docstring)."""

    prompt_mode: PromptMode = "context"
    length: int = 1024
    hops: int = 4
    chains: int = 1
    source: str = "stdlib"
    train_source: str = "code"
    name: str = field(default="vartrack", init=False)
    kind: TaskKind = field(default="qa", init=False)
    labels: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        if self.hops < 1 or self.chains < 1:
            raise KTMError(f"vartrack hops and chains must be >= 1, got hops={self.hops}, "
                           f"chains={self.chains}")
        if self.length < 16:
            raise KTMError(f"vartrack length must be >= 16 tokens, got {self.length}")

    @property
    def answer_tokens(self) -> int:
        return 5 * self.hops + 4

    def _examples(self, n: int, seed: int, train: bool) -> list[Example]:
        self.tokens()  # bound, or an error saying so
        lines = haystack.lines_of(self.train_source if train else self.source, train)
        rng = random.Random(f"vartrack:{seed}:{train}")
        return [self._example(lines, rng) for _ in range(n)]

    def _example(self, lines, rng: random.Random) -> Example:
        names = set()
        while len(names) < self.hops * self.chains:
            names.add("".join(rng.choices(string.ascii_uppercase, k=5)))
        names = sorted(names)
        rng.shuffle(names)
        values = rng.sample(range(10000, 100000), self.chains)
        inserts, chains = [], []
        for c, value in enumerate(values):
            chain = names[c * self.hops:(c + 1) * self.hops]
            chains.append(chain)
            text = [f"{chain[0]} = {value}"] + [f"{b} = {a}" for a, b in zip(chain, chain[1:])]
            inserts += list(zip(sorted(rng.random() for _ in chain), text))
        hay = haystack.fit(lines, self.length, [t for _, t in inserts], self._tokens, rng)
        doc, _ = haystack.insert(hay, inserts)
        value, answers = values[0], chains[0]
        question = (f"\nQuestion: which variables hold the value {value}? Answer: The variables "
                    f"holding {value} are")
        return Example(qa_prompt(doc, question, self.prompt_mode),
                       " " + ", ".join(answers) + ".",
                       meta={"answers": answers, "depth": None,
                             "tokens": self._tokens.count(doc)})
