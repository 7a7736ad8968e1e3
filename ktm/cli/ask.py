"""``ktm ask FILE... --question TEXT``: read files (or folders) and answer a question about them.

The files are joined into one document, each under a ``# File: PATH`` line, and asked about as
a user asks ``ktm serve``'s chat: one user message, the document and then the question, read
through the model's chat template (``ktm.serving.prompts.chat_prompt``: the question split off
and read plain, the document merged); a model without a chat template reads
``[Segment(document), Segment("Question: ...\nAnswer:", question=True)]``. A bare question
after a merged document gets no answer from the instruct model (its first token is EOS, 0 of 20
needles), the chat layout and the answer cue about half of them (results/question/README.md).
The question reader for chats (``smollm2-135m-k4-qa-chat`` by default: asked in a chat it finds
the needle in 1,024 tokens 19 times in 20, as the plain reading, where ``smollm2-135m-k4-qa``
finds 11; ``results/question/README.md``, the entries table) reads the document merged, the
lines the question asks about plain, and a document past the model's window at the ratio that fits
it (``ktm.core.fit``). The answer streams to standard output; the tokens read, the positions they
took, the time to the first token and in all go to standard error. The runtime is torch unless
``--backend`` says otherwise (llama.cpp's first call exports the model, minutes on a CPU).

A folder is read whole, its files in name order, leaving out hidden entries and files that are
not UTF-8 text (each one named on standard error); a file named on the command line must be
text. ``-`` reads standard input.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ktm.errors import KTMError

DEFAULT_READER = "smollm2-135m-k4-qa-chat"


@dataclass
class AskConfig:
    paths: tuple[str, ...] = field(default=(), metadata={
        "help": "files or folders to read ('-': standard input)"})
    question: str = field(default="", metadata={"help": "what to ask about them"})
    reader: str = field(default=DEFAULT_READER, metadata={
        "help": "the reader (a shipped name or a checkpoint folder) or a base model"})
    max_new_tokens: int = field(default=64, metadata={"help": "the answer's longest length"})
    progress: bool = field(default=True, metadata={"help": "a progress bar while reading"})

    def __post_init__(self) -> None:
        if not self.paths:
            raise KTMError("nothing to read: expected one or more files or folders")
        if not self.question.strip():
            raise KTMError("no question: expected --question TEXT")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise KTMError(f"max_new_tokens must be an integer >= 1, got "
                           f"{self.max_new_tokens!r}")


def read_document(paths: tuple[str, ...], progress: bool = True) -> tuple[str, list[str]]:
    """(the document, the files read): each file's text under a ``# File: PATH`` line."""
    files: list[tuple[str, Path | None]] = []
    for p in paths:
        if p == "-":
            files.append(("<stdin>", None))
            continue
        path = Path(p)
        if path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file() and not any(
                part.startswith(".") for part in f.relative_to(path).parts))
            files += [(str(f), f) for f in found]
        elif path.is_file():
            files.append((p, path))
        else:
            raise KTMError(f"cannot read {p!r}: no such file or folder")
    parts, read = [], []
    for name, path in tqdm(files, desc="read files", unit="file", disable=not progress,
                           leave=False):
        try:
            text = (sys.stdin.buffer.read() if path is None else path.read_bytes()
                    ).decode("utf-8")
        except UnicodeDecodeError:
            if name in paths:  # named on the command line: the user meant it
                raise KTMError(f"{name!r} is not UTF-8 text: expected text files") from None
            print(f"ktm ask: skipping {name} (not UTF-8 text)", file=sys.stderr)
            continue
        except OSError as e:
            raise KTMError(f"cannot read {name!r}: {e.strerror}") from None
        parts.append(f"# File: {name}\n{text.rstrip()}\n")
        read.append(name)
    if not parts:
        raise KTMError(f"no text file in {', '.join(paths)}: expected UTF-8 text")
    return "\n".join(parts), read


def ask(config: AskConfig, model=None, out=None) -> dict:
    """Answer ``config.question`` about ``config.paths`` (``model``: one already loaded, else
    ``config.reader`` on torch), the answer streamed to ``out`` (None: standard output).
    Returns the answer and what it took: files, tokens, positions, seconds."""
    from ktm.model import load_any

    out = sys.stdout if out is None else out
    document, files = read_document(config.paths, config.progress)
    if model is None:
        model = load_any(config.reader)
    asked = asked_prompt(model, document, config.question)
    read = stream_answer(model, asked, config.max_new_tokens, out, progress=config.progress)
    cp, first, total = read["layout"], read["first_token_s"], read["seconds"]
    row = {"answer": read["answer"], "files": files, "tokens": cp.tokens_in,
           "positions": cp.next_position, "ratio_read": cp.ratio_read,
           "fitted": read["fitted"], "first_token_s": first, "seconds": total}
    fit = " (fitted to the window)" if row["fitted"] else ""
    ratio = "" if row["ratio_read"] is None else f", ratio {row['ratio_read']:.2f}"
    print(f"[{len(files)} file(s), {cp.tokens_in} tokens read in {cp.next_position} positions"
          f"{ratio}{fit}; first token {first or total:.1f} s, in all {total:.1f} s]",
          file=sys.stderr)
    return row


def stream_answer(model, prompt, max_new_tokens: int, out, merge: bool = True,
                  progress: bool = False) -> dict:
    """Read ``prompt`` as generation reads it (fitted to the window where it runs past it,
    ``ktm.core.fit``; the fit is not warned of: ``fitted`` says it) and stream its answer to
    ``out``, a line at its end. Returns the answer, the prompt as read (``prompt``), its layout
    (``layout``: a ``CompressedPrompt`` without embeddings), whether it was ``fitted``, and the
    seconds to the first piece (None: no text) and in all, counted once it is laid out."""
    from ktm.core.allocate import RatioWarning
    from ktm.core.fit import encode_fitted

    prompt = tuple(prompt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RatioWarning)
        (read,), (cp,) = encode_fitted(model, [prompt], merge, [max_new_tokens - 1],
                                       embed=False)
    bar = tqdm(total=1, desc=f"read {cp.tokens_in} tokens in {cp.next_position} positions",
               disable=not progress, leave=False, bar_format="{desc}")
    start, first, pieces = time.perf_counter(), None, []
    for piece in model.stream(read, max_new_tokens=max_new_tokens, merge=merge):
        if first is None:
            first = time.perf_counter() - start
            bar.close()
        pieces.append(piece)
        print(piece, end="", flush=True, file=out)
    print(file=out)
    bar.close()
    return {"answer": "".join(pieces), "prompt": read, "layout": cp, "fitted": read != prompt,
            "first_token_s": first, "seconds": time.perf_counter() - start}


def asked_prompt(model, document: str, question: str) -> tuple:
    """The prompt ``ask`` reads: the document and the question as one user message through the
    model's chat template, else the document merged and the question plain with an answer cue."""
    from ktm.core.question import asking
    from ktm.serving.prompts import chat_prompt

    question = " ".join(question.split())  # one line: the message's end is split off whole
    if getattr(model.tokenizer, "chat_template", None):
        return tuple(chat_prompt(model, [{"role": "user", "content": f"{document}\n\n{question}"}]))
    return tuple(asking(document, f"\nQuestion: {question}\nAnswer:"))
