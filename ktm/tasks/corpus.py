"""Unlabeled text for reader pretraining and the readability metric: sources, documents, windows.

Training sources are the *train* sides of the shipped data, never their labels, or your own text:

    code             old and new code of the CommitPack train-side commits (every length)
    reviews          Amazon Fashion train-split review texts (no ratings)
    trees[:S,S...]   train-split trees of the tree stages, as the tree task shows them ("Tree: ...")
    PATH             a text file (one document), a JSONL or JSON file of records (field
                     ``text_field``), or a folder of such files (below)

Held-out sources (evaluation only, for the readability metric) are reviews of other product
categories and code from repositories absent from the training file. They are refused as training
text, by name, wherever they appear.

A window is cut from one document: ``context`` tokens the encoder merges and ``target`` tokens the
loss covers (the plain continuation, or the context itself for autoencoding).

A user's own text (a PATH source): the files of a source path, each read once, as text or
records.

    PATH.txt, .md, .py, ...   one document; line ends normalised to "\n" (CRLF and CR too)
    PATH.jsonl, PATH.json     records: the ``text_field`` of each, verbatim (a string in JSON is
                              data: a "\r\n" inside it stays); a .json holds a list of records,
                              one record, or is JSONL under another name. Inside a folder a .json
                              that holds no such records (a code corpus's package.json) is one
                              text document, as the code around it
    FOLDER                    the files above below it, recursively, sorted, each real file once

Any of them may be gzipped. An archive or a binary file is never text: given as a source it is
refused; in a folder it is skipped with one warning line naming it.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ktm.core.tokens import raw_text_ids
from ktm.errors import KTMError
from ktm.tasks.jsonl import base_name, check_utf8, is_gzip, open_text, read_jsonl
from ktm.util.field_types import check_at_least

EVAL_ONLY_NAMES = ("amazon_reviews_other", "amazon_other_categories_2018.jsonl.gz",
                   "heldout_repos_test.jsonl.gz")
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".gz", ".csv", ".tsv", ".html",
                 ".c", ".h", ".cpp", ".js", ".ts", ".java", ".go", ".rs", ".sh", ".yaml", ".yml",
                 ".toml", ".tex")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".zip",
                    ".7z", ".rar", ".bz2", ".xz", ".zst", ".whl", ".jar")
_ARCHIVE_MAGIC = (b"PK\x03\x04", b"7z\xbc\xaf\x27\x1c", b"Rar!")  # zip (.whl, .jar), 7z, rar
_SNIFF = 8192  # bytes read to tell a binary file from text


def refuse_eval_only(path: Path) -> None:
    hit = {base_name(p) for p in path.parts}.intersection(base_name(n) for n in EVAL_ONLY_NAMES)
    if hit:
        raise KTMError(f"{path} is an evaluation-only set ({sorted(hit)[0]}): it is never used "
                       "for training, not even its text; expected training text")


def not_text(path: Path) -> str | None:
    """Why ``path`` is no text file (an archive, NUL bytes), or None. Read from its name and
    its first bytes (gunzipped if gzip): a tar archive under .gz is gzip too, and tar headers
    and NULs read as text are noise a reader would learn."""
    name = path.name.lower()
    if name.endswith(ARCHIVE_SUFFIXES):
        return "an archive"
    try:
        if is_gzip(path):
            with gzip.open(path, "rb") as f:
                head = f.read(_SNIFF)
        else:
            with path.open("rb") as f:
                head = f.read(_SNIFF)
    except (OSError, EOFError, zlib.error):
        return None  # reading it says what is wrong, naming it
    if head.startswith(_ARCHIVE_MAGIC) or head[257:262] == b"ustar":  # tar: "ustar" at 257
        return "an archive"
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return None  # UTF-16 text: check_utf8 names it as such
    if b"\x00" in head:
        return "a binary file (it holds NUL bytes)"
    return None


def file_texts(path: Path, text_field: str, in_folder: bool = False) -> list[str]:
    """The texts of one file (module docstring); an archive or binary file is an error.
    ``in_folder``: a file ``folder_files`` listed, whose first bytes it has read already
    (``not_text``), and a .json without records of ``text_field`` is a text, not an error."""
    refuse_eval_only(path.resolve())
    if not in_folder and (why := not_text(path)) is not None:
        raise KTMError(f"{path} is {why}, not text: expected a text, JSON or JSONL file "
                       "(gzipped or not); unpack an archive into a folder and pass that")
    name = base_name(path.name.lower())
    if name.endswith(".jsonl"):
        return _records(path, read_jsonl(path), text_field)
    text = _read(path)
    if name.endswith(".json"):
        try:
            return _json_texts(path, text, text_field)
        except KTMError:
            if in_folder:
                return [text]
            raise
    return [text]


def _read(path: Path) -> str:
    try:
        # gzipped or not, whatever its name (the folder listing takes .gz); a BOM is not text;
        # universal newlines: a text file's CRLF and CR line ends are read as "\n"
        with open_text(path) as f:
            text = f.read()
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: a damaged gzip stream
        raise KTMError(f"cannot read {path}: {e} (expected a text file, gzip if .gz)") from None
    check_utf8(path, text)
    return text


def _json_texts(path: Path, text: str, text_field: str) -> list[str]:
    """A .json file: a list of records or one record; JSONL under a .json name is read as
    JSONL. Anything else is refused: its raw JSON is not text to learn from."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one JSON value per line: JSONL
            return _records(path, read_jsonl(path), text_field)
        raise KTMError(f"{path}: bad JSON ({e.msg}, line {e.lineno}): expected a list of "
                       f"records with a {text_field!r} field, or JSONL") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        bad = type(value).__name__ if not isinstance(value, list) else "a list of " + next(
            type(v).__name__ for v in value if not isinstance(v, dict))
        raise KTMError(f"{path} holds {bad}: expected a list of records (JSON objects) with a "
                       f"{text_field!r} field, or JSONL; plain text belongs in a .txt file")
    return _records(path, ((i, row) for i, row in enumerate(value, start=1)), text_field, "record")


def _records(path: Path, rows, text_field: str, unit: str = "line") -> list[str]:
    """``text_field`` of each ``(number, row)``, verbatim."""
    out = []
    for n, row in rows:
        value = row.get(text_field)
        if text_field not in row:
            raise KTMError(f"{path} {unit} {n}: no field {text_field!r} (its fields: "
                           f"{', '.join(map(repr, row)) or 'none'}); expected the text "
                           "there, or --text-field naming the field that holds it")
        if not isinstance(value, str):
            raise KTMError(f"{path} {unit} {n}: expected a string field {text_field!r}, "
                           f"got {type(value).__name__}")
        out.append(value)
    return out


def folder_files(root: Path) -> list[Path]:
    """The text files below ``root``, sorted, each real file once (a file linked in twice is
    one document, not two). Hidden files and folders (.git, .venv, .ipynb_checkpoints) are not
    the corpus; a linked folder is (``ln -s /data/books corpus/``: ``Path.rglob`` skipped it
    silently), each real folder read once, so a link loop ends. Archives and binary files are
    skipped, with one warning line naming them."""
    seen: set[str] = set()
    found = []
    for folder, subfolders, names in os.walk(root, followlinks=True):
        if (real := os.path.realpath(folder)) in seen:
            subfolders.clear()
            continue
        seen.add(real)
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        found += [Path(folder, n) for n in names if not n.startswith(".")
                  and n.lower().endswith(TEXT_SUFFIXES + ARCHIVE_SUFFIXES)
                  and Path(folder, n).is_file()]
    files, skipped, real_files = [], [], set()
    for path in sorted(found):
        if (real := os.path.realpath(path)) in real_files:
            continue
        real_files.add(real)
        (skipped if not_text(path) is not None else files).append(path)
    if skipped:
        names = ", ".join(str(p.relative_to(root)) for p in skipped)
        warnings.warn(f"{root}: skipped {len(skipped)} archive or binary file"
                      f"{'s' * (len(skipped) > 1)} (not text): {names}", UserWarning,
                      stacklevel=2)
    return files


BUILTIN = ("code", "reviews", "trees")
HELDOUT = ("reviews", "code", "stdlib")
# held-out "stdlib": Python standard-library modules that no file of the project imports, read
# from the running Python's own sources (text no project file holds, and never trained on)
STDLIB_MODULES = ("difflib", "fractions", "calendar", "colorsys", "sched", "graphlib", "netrc",
                  "tabnanny", "pprint", "reprlib", "fnmatch", "gettext", "mailbox", "imaplib",
                  "ftplib", "smtplib", "poplib", "plistlib", "configparser")
STDLIB_LINES = 60  # a module's source is cut into documents of this many lines
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
        check_at_least(self, 1, "context_tokens", "target_tokens", "ae_tokens")
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


RECALL_CUE, RECALL_TARGET = 8, 16  # recall R: the copied question and what follows it


def recall_question(window: Window, seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(question, target) of a window's recall reading: ``RECALL_CUE`` tokens from a place in
    its context drawn uniformly (seeded by ``seed`` and the context), and the ``RECALL_TARGET``
    tokens after them; the place never depends on the reader or the layout."""
    ctx = window.context
    if len(ctx) < 2:
        raise KTMError(f"a recall question needs a context of at least 2 tokens, got {len(ctx)}")
    # a context shorter than the whole span keeps a third of it for the question
    cue = min(RECALL_CUE, max(1, len(ctx) // 3))
    span = cue + min(RECALL_TARGET, len(ctx) - cue)
    start = random.Random(f"{seed}:{zlib.crc32(bytes(str(ctx), 'ascii'))}").randrange(
        len(ctx) - span + 1)
    return ctx[start:start + cue], ctx[start + cue:start + span]


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


def stdlib_texts() -> list[str]:
    """The ``stdlib`` held-out set: each of ``STDLIB_MODULES``' sources that this Python has,
    cut into documents of ``STDLIB_LINES`` lines. Needs no data folder."""
    import importlib.util

    out = []
    for name in STDLIB_MODULES:
        spec = importlib.util.find_spec(name)
        try:
            lines = Path(spec.origin).read_text(encoding="utf-8").splitlines(keepends=True)
        except (AttributeError, TypeError, OSError, UnicodeDecodeError):
            continue  # a Python without the module's source (only .pyc)
        out += ["".join(lines[i:i + STDLIB_LINES]) for i in range(0, len(lines), STDLIB_LINES)]
    return out


def is_heldout(name: str) -> bool:
    """Whether ``name`` is something R reads: a held-out set, or a file or folder of text."""
    return name in HELDOUT or Path(name).expanduser().exists()


def heldout_texts(name: str) -> list[str]:
    """Evaluation-only text for the readability metric: ``reviews``, ``code`` or ``stdlib``."""
    from ktm.tasks.jsonl import resolve_data_path

    if name == "stdlib":
        return stdlib_texts()
    if name == "reviews":
        from ktm.tasks.amazon import OTHER_CATEGORIES_FILE, load_reviews

        path = resolve_data_path(None, OTHER_CATEGORIES_FILE)
        return [r.text for r in load_reviews(path, None, for_training=False)]
    if name == "code":
        from ktm.tasks.commitpack import HELDOUT_FILE, load_commits

        return [c.new for c in load_commits(resolve_data_path(None, HELDOUT_FILE), None)]
    if is_heldout(name):  # the user's own text, a file or a folder
        return path_texts(name)
    raise KTMError(f"unknown held-out set {name!r}: expected one of {', '.join(HELDOUT)}, or "
                   "an existing file or folder of text")


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
