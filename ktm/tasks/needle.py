"""Needles in a haystack: a line holding a fact, put at a chosen depth of a long document, and a
question about it after the document (RULER's needle tasks, on any text).

    [document of `length` tokens with needle lines at their depths, merged]
    [ "\\nQuestion: what is the secret code for Mateo? Answer: The secret code for Mateo is",
      plain ] -> " 8056020."

Variants:

    single      one needle, asked about
    multikey    ``keys`` needles of distinct keys (names), one of them asked about: the others
                are distractors of the same form
    multivalue  ``values`` needles of one key, each with its own value, all asked for: a hit
                needs every value

A hit is every asked value in the greedy answer (``ktm.evaluation.evaluate``'s ``qa`` kind).
The needle's depth is ``depth``, or spread evenly over [0, 1] across the examples (each
example records its own, so the result row breaks accuracy down by depth). Documents come from
``source`` (``ktm.tasks.haystack``), cut to ``length`` tokens of the model's tokenizer
(``bind``): the default ``stdlib`` is evaluation-only, so training examples come from
``train_source``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from ktm.errors import KTMError
from ktm.tasks import haystack
from ktm.tasks.base import Example, PromptMode, TaskKind, qa_prompt
from ktm.tasks.questions import QuestionTask

# keys: names, each one token of common tokenizers' vocabularies in most cases, none a Python
# word (so that code holds none of them)
NAMES = ("Alice", "Boris", "Chen", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas",
         "Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara",
         "Umar", "Vera", "Wanda", "Xavier", "Yusuf", "Zoe", "Amir", "Bianca", "Carlos", "Dara")


@dataclass
class NeedleTask(QuestionTask):
    """Needle questions over long documents (module docstring)."""

    prompt_mode: PromptMode = "context"
    length: int = 1024
    variant: Literal["single", "multikey", "multivalue"] = "single"
    keys: int = 4  # multikey: needles of distinct keys
    values: int = 4  # multivalue: values of the one key
    depth: float | None = None  # None: spread evenly over [0, 1] across the examples
    source: str = "stdlib"
    train_source: str = "code"
    needle: str = "# The secret code for {key} is {value}."
    name: str = field(default="needle", init=False)
    kind: TaskKind = field(default="qa", init=False)
    labels: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        if self.length < 16:
            raise KTMError(f"needle length must be >= 16 tokens, got {self.length}")
        if not 2 <= self.keys <= len(NAMES):
            raise KTMError(f"needle keys must be in [2, {len(NAMES)}], got {self.keys}")
        if self.values < 2:
            raise KTMError(f"needle values must be >= 2, got {self.values}")
        if "{key}" not in self.needle or "{value}" not in self.needle or "\n" in self.needle:
            raise KTMError(f"needle {self.needle!r} must be one line holding {{key}} and "
                           "{value}")

    @property
    def answer_tokens(self) -> int:
        """New tokens an answer gets: room for every asked value."""
        return 12 * (self.values if self.variant == "multivalue" else 1)

    def _examples(self, n: int, seed: int, train: bool) -> list[Example]:
        self.tokens()  # bound, or an error saying so
        lines = haystack.lines_of(self.train_source if train else self.source, train)
        rng = random.Random(f"needle:{seed}:{train}")
        return [self._example(lines, d, rng)
                for d in haystack.depths(n, self.depth)]

    def _example(self, lines, depth: float, rng: random.Random) -> Example:
        count = {"single": 1, "multikey": self.keys, "multivalue": self.values}[self.variant]
        keys = rng.sample(NAMES, count if self.variant == "multikey" else 1)
        values = [str(rng.randrange(10 ** 6, 10 ** 7)) for _ in range(count)]
        facts = [(keys[i % len(keys)], v) for i, v in enumerate(values)]
        asked = keys[0] if self.variant != "multikey" else rng.choice(keys)
        needles = [self.needle.format(key=k, value=v) for k, v in facts]
        # the asked needle at the example's depth, the others at drawn depths
        places = [depth if k == asked and (self.variant != "multivalue" or i == 0)
                  else rng.random() for i, (k, _) in enumerate(facts)]
        hay = haystack.fit(lines, self.length, needles, self._tokens, rng)
        doc, where = haystack.insert(hay, list(zip(places, needles)))
        answers = [v for k, v in facts if k == asked]
        if self.variant == "multivalue":
            question = (f"\nQuestion: what are all the secret codes for {asked}? Answer: The "
                        f"secret codes for {asked} are")
            target = " " + ", ".join(answers) + "."
        else:
            question = (f"\nQuestion: what is the secret code for {asked}? Answer: The secret "
                        f"code for {asked} is")
            target = f" {answers[0]}."
        at = next(i for i, (k, _) in enumerate(facts) if k == asked)  # the needle at depth
        before, total = self._tokens.before(doc, [where[at], len(doc)])
        return Example(qa_prompt(doc, question, self.prompt_mode), target,
                       meta={"answers": answers, "depth": depth, "variant": self.variant,
                             "tokens": total, "at_token": before})
