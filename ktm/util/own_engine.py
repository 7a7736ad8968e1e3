"""The torch runtime's options on a runtime whose engine keeps its own KV cache, runs its own
graphs and reads its own weight types (``LlamaCppRuntime``, ``VLLMRuntime``).

The runtime contract (``ktm.decode.runtime.Runtime``) declares every option a caller may ask
for; here they stand at what such an engine does: no KV press (kvpress cannot reach the cache),
no answer merged into the cache (``merge_window``), nothing of ktm's compiled and the weights
read as the engine holds them. Callers ask ``presses`` and ``merges`` before they use either and
refuse by name; an option set to what it already means is taken (the server sets its defaults
on every runtime), any other is refused.
"""

from __future__ import annotations

from ktm.errors import KTMError


class OwnEngine:
    name: str
    presses = False  # the KV cache is the engine's: kvpress cannot reach it
    press = None
    merges = False  # no merge_window: the answer's KV is the engine's too
    compiles = 0  # ktm's compiled step never runs here

    @property
    def compile(self) -> str:
        """"off": ktm's compiled step never runs here; the engine runs its own graphs."""
        return "off"

    @compile.setter
    def compile(self, mode: str) -> None:
        if mode not in ("auto", "off"):  # "auto": compiled where that pays, which is nowhere here
            raise KTMError(f"compile={mode!r} is an option of the torch backend, not "
                           f"{self.name} (llama.cpp and vLLM run their own graphs)")

    @property
    def weights(self) -> str:
        """"native": the engine reads the weight types of its own files."""
        return "native"

    @weights.setter
    def weights(self, weights: str) -> None:
        if weights != "native":
            raise KTMError(f"weights={weights!r} is an option of the torch backend, not "
                           f"{self.name} (llama.cpp and vLLM read their own weight types)")

    def use_press(self, press) -> None:
        """None only: no press reaches the engine's KV cache."""
        if press is not None:
            raise KTMError(f"press {press.name!r} cannot reach the KV cache of the {self.name} "
                           "backend (its runtime presses nothing): expected no press")

    def merge_due(self, window: int, plain: int) -> int:
        raise KTMError(f"merge_window={window}: the {self.name} backend merges no answer into "
                       "its KV cache (its runtime merges nothing)")

    def merge_generated(self, state, ids, plain: int) -> None:
        raise KTMError(f"the {self.name} backend merges no answer into its KV cache (its "
                       "runtime merges nothing)")
