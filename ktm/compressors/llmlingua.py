"""LLMLingua through the real ``llmlingua`` package (0.2.2), run offline on a local model folder.

Token-level LLMLingua (perplexity filter of a small causal LM) uses the base model's own folder
by default (``model_name=`` overrides it). Each compressed segment is one context; the context-
and sentence-level filters are off (one context per call, nothing to rank), so only the
token-level filter runs, at ``rate = 1 - ratio``.

Offline shims, each as small as it can be:

* tiktoken: ``PromptCompressor.__init__`` asks tiktoken for the gpt-3.5-turbo encoding, which
  tiktoken downloads at run time. We construct it with ``tiktoken.encoding_for_model`` patched
  out, then give it a counter over the compression model's own tokenizer as ``oai_tokenizer``.
  So llmlingua's budgets (``rate``, ``origin_tokens``) are counted in the same tokens as ours.
* nltk punkt: only the sentence-level filter uses it, and it stays off; nothing is downloaded.
* One window: llmlingua 0.2.2 reuses its KV cache across 200-token windows by unpacking it as
  ``for k, v in past_key_values``, which fails on transformers 5's cache objects ("too many
  values to unpack"), so ``iterative_size`` is set to the segment's length and the whole
  segment is scored in one pass, with no cache reuse (quadratic in length on long segments). It
  must be exactly the length: a longer window makes llmlingua's slicing keep almost every token.

LLMLingua-2 needs a token-classification checkpoint that cannot be downloaded here: it runs only
with ``llmlingua2_model=PATH`` (a local folder), else a KTMError says so.

``question_aware=True`` is LongLLMLingua (llmlingua's ``rank_method="longllmlingua"``): the
segment is cut into chunks of whole lines (about ``CHUNK_TOKENS`` tokens each), which
llmlingua ranks by how well each predicts the prompt's question (its plain segments after the
last compressed one), keeps the best at the coarse level and compresses the kept ones token by
token, each chunk's rate set by its rank (``dynamic_context_compression_ratio`` 0.3); the
chunks stay in their order. The token level reads perplexities without the question before
the chunks (``condition_in_question="after"`` and no ``condition_compare``, not the paper's
``"after_condition"`` with the contrastive perplexity): with the question written first,
llmlingua 0.2.2 asserts that it and the first chunk tokenize apart, which fails wherever a chunk
starts with whitespace the tokenizer joins to the question's line break (indented code). The
same single window as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

from ktm.compressors.base import Compressor, check_ratio
from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.tasks.base import Example

INSTALL = "pip install --no-deps llmlingua==0.2.2 tiktoken==0.14.0 nltk==3.10.4"
CHUNK_TOKENS = 128  # LongLLMLingua: the chunks a segment is cut into, each one of its contexts


class _TokenCounter:
    """Stands in for tiktoken's ``Encoding``: llmlingua only calls ``encode`` to count tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def build_prompt_compressor(model_dir: str | Path, llmlingua2: bool = False,
                            device: str = "cpu"):
    """``llmlingua.PromptCompressor`` on a local folder and ``device``, with no network access."""
    try:
        import llmlingua.prompt_compressor as lp
    except ImportError as e:
        raise KTMError(f"the llmlingua baseline needs the llmlingua package ({e}); "
                       f"run: {INSTALL}") from e
    # the gpt-3.5-turbo encoding would be downloaded here; our counter replaces it just below
    with mock.patch.object(lp.tiktoken, "encoding_for_model", lambda _name: None):
        pc = lp.PromptCompressor(model_name=str(model_dir), device_map=device,
                                 model_config={"trust_remote_code": False},
                                 use_llmlingua2=llmlingua2)
    pc.oai_tokenizer = _TokenCounter(pc.tokenizer)
    return pc


class LLMLingua(Compressor):
    name: ClassVar[str] = "llmlingua"

    def __init__(self, ratio: float = 0.5, model_name: str | None = None,
                 llmlingua2_model: str | None = None, llmlingua2: bool = False,
                 question_aware: bool = False):
        super().__init__()
        self.ratio = check_ratio(ratio)
        if question_aware and (llmlingua2 or llmlingua2_model):
            raise KTMError("question_aware (LongLLMLingua) ranks with a causal LM: expected it "
                           "without llmlingua2")
        self.question_aware = question_aware
        if llmlingua2 and not llmlingua2_model:
            raise KTMError("LLMLingua-2 needs its token-classification weights, which cannot be "
                           "downloaded here: pass llmlingua2_model=PATH (a local HF folder)")
        if llmlingua2_model and not (Path(llmlingua2_model) / "config.json").is_file():
            raise KTMError(f"llmlingua2_model={llmlingua2_model!r} is not a local HF model "
                           "folder (no config.json)")
        self.model_name, self.llmlingua2_model = model_name, llmlingua2_model
        self._pc = None

    def options(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "model_name": self.model_name,
                "llmlingua2_model": self.llmlingua2_model,
                "question_aware": self.question_aware}

    def fit(self, examples: Sequence[Example], model) -> None:
        from ktm.core.base_model import resolve_model_path

        super().fit(examples, model)
        if self.llmlingua2_model:
            self._pc = build_prompt_compressor(self.llmlingua2_model, llmlingua2=True,
                                               device=str(model.device))
        else:
            self._pc = build_prompt_compressor(
                resolve_model_path(self.model_name or model.config.base_model),
                device=str(model.device))

    def compress_text(self, text: str, question: str = "") -> str:
        rate = 1.0 - self.ratio
        if self.question_aware:
            chunks = self._chunks(text)
            n = sum(len(self._pc.tokenizer(c, add_special_tokens=False)["input_ids"])
                    for c in chunks)
            out = self._pc.compress_prompt(
                chunks, question=question, rate=rate, iterative_size=n,
                rank_method="longllmlingua", condition_in_question="after",
                condition_compare=False, reorder_context="original",
                dynamic_context_compression_ratio=0.3, context_budget="+100",
                use_sentence_level_filter=False, concate_question=False)
            return out["compressed_prompt"]
        if self.llmlingua2_model:
            out = self._pc.compress_prompt_llmlingua2([text], rate=rate)
        else:
            # the window must be exactly the segment: llmlingua's window arithmetic misreads a
            # window longer than the text (negative slice bounds keep almost every token)
            n = len(self._pc.tokenizer(text, add_special_tokens=False)["input_ids"])
            out = self._pc.compress_prompt(
                [text], rate=rate, iterative_size=n, use_context_level_filter=False,
                use_sentence_level_filter=False, concate_question=False)
        return out["compressed_prompt"]

    def _chunks(self, text: str) -> list[str]:
        """``text`` as chunks of whole lines of about ``CHUNK_TOKENS`` tokens each."""
        out, now, size = [], "", 0
        for line in text.splitlines(keepends=True):
            n = len(self._pc.tokenizer(line, add_special_tokens=False)["input_ids"])
            if now and size + n > CHUNK_TOKENS:
                out.append(now)
                now, size = "", 0
            now, size = now + line, size + n
        return out + ([now] if now else [])

    def rewrite(self, texts: list[str], first: list[bool],
                questions: list[str] | None = None) -> list[Segment]:
        questions = questions or [""] * len(texts)
        return [Segment(self.compress_text(t, q) if t.strip() else t)
                for t, q in zip(texts, questions)]
