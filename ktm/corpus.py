"""Unlabeled text for reader pretraining and the readability metric: sources, documents, windows.

Training sources are the *train* sides of the shipped data, never their labels, or your own text:

    code             old and new code of the CommitPack train-side commits (every length)
    reviews          Amazon Fashion train-split review texts (no ratings)
    trees[:S,S...]   train-split trees of the tree stages, as the tree task shows them ("Tree: ...")
    PATH             a text file (one document), a JSONL or JSON file of records (field
                     ``text_field``), or a folder of such files (``ktm.corpus_files``)

Held-out sources (evaluation only, for the readability metric) are reviews of other product
categories and code from repositories absent from the training file. They are refused as training
text, by name, wherever they appear.

A window is cut from one document: ``context`` tokens the encoder merges and ``target`` tokens the
loss covers (the plain continuation, or the context itself for autoencoding).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ktm.corpus_files import (  # noqa: F401  (EVAL_ONLY_NAMES, TEXT_SUFFIXES: public here too)
    EVAL_ONLY_NAMES,
    TEXT_SUFFIXES,
    file_texts,
    folder_files,
    refuse_eval_only,
)
from ktm.errors import KTMError
from ktm.tokens import raw_text_ids

BUILTIN = ("code", "reviews", "trees")
HELDOUT = ("reviews", "code")
DEFAULT_TREE_STAGES = ("small", "xmedium", "medium")


@dataclass(frozen=True)
class WindowSpec:
    """How windows are cut. A document shorter than ``context + target`` gives one window whose
    target is a quarter of it; a document under ``min_tokens`` gives none."""

    context_tokens: int = 256
    target_tokens: int = 64
    ae_tokens: int = 128  # longest context to autoencode (the target is as long as it)
    min_tokens: int = 32

    def __post_init__(self) -> None:
        for name in ("context_tokens", "target_tokens", "ae_tokens"):
            if getattr(self, name) < 1:
                raise KTMError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.min_tokens < 2:
            raise KTMError(f"min_tokens must be >= 2 (a context and a target), "
                           f"got {self.min_tokens}")


@dataclass(frozen=True)
class Window:
    context: tuple[int, ...]
    target: tuple[int, ...]
    source: str


def continuation_window(doc: np.ndarray, spec: WindowSpec, rng: random.Random, source: str
                        ) -> Window:
    """A context and the plain tokens that follow it, at a random offset in ``doc``."""
    full = spec.context_tokens + spec.target_tokens
    span = min(len(doc), full)
    n_target = spec.target_tokens if span == full else min(spec.target_tokens, max(1, span // 4))
    start = rng.randrange(len(doc) - span + 1)
    ids = doc[start:start + span].tolist()
    return Window(tuple(ids[:span - n_target]), tuple(ids[span - n_target:]), source)


def autoencode_window(doc: np.ndarray, spec: WindowSpec, rng: random.Random, source: str
                      ) -> Window:
    """A span of ``doc`` that is both the merged context and the target to regenerate."""
    span = min(len(doc), spec.ae_tokens)
    start = rng.randrange(len(doc) - span + 1)
    ids = tuple(doc[start:start + span].tolist())
    return Window(ids, ids, source)


# ------------------------------------------------------------------ texts
def path_texts(spec: str, text_field: str = "text") -> list[str]:
    """Texts of a user file or folder (folders: text files below it, recursively, sorted)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return file_texts(path, text_field)
    if path.is_dir():
        refuse_eval_only(path.resolve())
        files = folder_files(path)
        if not files:
            raise KTMError(f"folder {str(path)!r} has no text files "
                           f"(expected files ending in {', '.join(TEXT_SUFFIXES[:6])}, ...)")
        return [t for f in files for t in file_texts(f, text_field, in_folder=True)]
    raise KTMError(f"text source {spec!r} is neither {', '.join(BUILTIN)}, trees:STAGE, "
                   "nor an existing file or folder")


def is_source(spec: str) -> bool:
    """Whether ``spec`` names a source as it is: a built-in one or an existing file or folder."""
    return (spec in BUILTIN or spec.startswith("trees:")
            or Path(spec).expanduser().exists())


def source_texts(spec: str, text_field: str = "text") -> list[str]:
    """The training texts of one source spec (see the module docstring)."""
    if spec == "code":
        from ktm.tasks.commitpack import CommitPackTask

        side = CommitPackTask(max_chars=None).train_side()
        return [t for c in side for t in (c.old, c.new) if t.strip()]
    if spec == "reviews":
        from ktm.tasks.amazon import AmazonTask

        return [r.text for r in AmazonTask(max_chars=None).train_reviews]
    if spec == "trees" or spec.startswith("trees:"):
        from ktm.tasks.tree import TreeTask

        stages = spec.split(":", 1)[1].split(",") if ":" in spec else DEFAULT_TREE_STAGES
        out = []
        for stage in stages:
            task = TreeTask(stage=stage)
            out += [f"Tree: {task.trees[i].text}" for i in task.train_trees]
        return out
    return path_texts(spec, text_field)


def heldout_texts(name: str) -> list[str]:
    """Evaluation-only text for the readability metric: ``reviews`` or ``code``."""
    from ktm.tasks.jsonl import resolve_data_path

    if name == "reviews":
        from ktm.tasks.amazon import OTHER_CATEGORIES_FILE, load_reviews

        path = resolve_data_path(None, OTHER_CATEGORIES_FILE)
        return [r.text for r in load_reviews(path, None, for_training=False)]
    if name == "code":
        from ktm.tasks.commitpack import HELDOUT_FILE, load_commits

        return [c.new for c in load_commits(resolve_data_path(None, HELDOUT_FILE), None)]
    raise KTMError(f"unknown held-out set {name!r}: expected one of {', '.join(HELDOUT)}")


# ------------------------------------------------------------------ documents
def tokenize_docs(tokenizer, texts: Sequence[str], min_tokens: int, desc: str = "tokenize"
                  ) -> list[np.ndarray]:
    """Token ids (no special tokens, a special token's string read as text: ``raw_text_ids``) of
    each text with at least ``min_tokens`` tokens."""
    docs: list[np.ndarray] = []
    step = 512
    for i in tqdm(range(0, len(texts), step), desc=desc, disable=len(texts) < 4 * step):
        for ids in raw_text_ids(tokenizer, texts[i:i + step]):
            if len(ids) >= min_tokens:
                docs.append(np.asarray(ids, dtype=np.int64))
    return docs


def check_docs(docs: list[np.ndarray], n_texts: int, spec: str, min_tokens: int) -> None:
    if n_texts == 0:
        raise KTMError(f"text source {spec!r} is empty: expected at least one text")
    if not docs:
        raise KTMError(f"text source {spec!r}: none of its {n_texts} texts has {min_tokens} "
                       f"tokens (one window); give longer texts or lower min_tokens")


def heldout_windows(tokenizer, name: str, n: int, spec: WindowSpec, seed: int = 0
                    ) -> list[Window]:
    """``n`` continuation windows from distinct held-out documents, fixed by ``seed``."""
    texts = heldout_texts(name)
    docs = tokenize_docs(tokenizer, texts, spec.min_tokens, desc=f"tokenize {name}")
    check_docs(docs, len(texts), name, spec.min_tokens)
    rng = random.Random(seed)
    picks = rng.sample(range(len(docs)), min(n, len(docs)))
    return [continuation_window(docs[i], spec, rng, name) for i in picks]
