"""What the question tasks (``needle``, ``vartrack``, ``codeqa``) share: lengths counted in the
model's tokens (``bind``), open questions (no labels), and training and evaluation examples made
the same way from a task's own ``_examples(n, seed, train)``."""

from __future__ import annotations

from ktm.errors import KTMError
from ktm.tasks import haystack
from ktm.tasks.base import Example


class QuestionTask:
    """A mixin of the question tasks' dataclasses (module docstring)."""

    name: str
    _tokens: haystack.Tokens | None = None  # set by ``bind``

    def bind(self, tokenizer) -> None:
        """Count lengths in this tokenizer's tokens (the model's: ``ktm.tasks.base.bind``)."""
        self._tokens = haystack.Tokens(tokenizer)

    def tokens(self) -> haystack.Tokens:
        """The bound token counter, or an error saying to bind one first."""
        if self._tokens is None:
            raise KTMError(f"the {self.name} task counts lengths in the model's tokens: bind it "
                           "to the model's tokenizer first (ktm.tasks.base.bind)")
        return self._tokens

    def label_target(self, label: str) -> str:
        raise KTMError(f"the {self.name} task asks open questions: it has no labels")

    def train_examples(self, n: int, seed: int) -> list[Example]:
        return self._examples(n, seed, train=True)

    def eval_examples(self, n: int, seed: int) -> list[Example]:
        return self._examples(n, seed, train=False)

    def _examples(self, n: int, seed: int, train: bool) -> list[Example]:
        raise NotImplementedError
