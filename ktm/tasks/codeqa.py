"""Questions about code in a long document: what a named function returns, which methods a named
class defines, what a name is set to, a parameter's default value, a function's parameters,
which function a line is in.

    [a stretch of Python modules of `length` tokens holding the function at `depth`, merged]
    [ "\\nQuestion: what does the function format_exception return? Answer:
       format_exception returns", plain ] -> " list(te.format(chain=chain))"

The functions and classes are real ones, found by parsing the source's modules (``ast``):

    returns   a function whose body ends in its only ``return``, of a one-line expression of at
              most ``RETURN_CHARS`` characters; a hit holds the expression (spaces aside)
    methods   a class of 2 to 6 methods (``__dunder__`` ones aside), at most 80 lines long; a
              hit names every method
    assign    a module's or a class's name given a value once (``NAME = expression``, one
              target, a one-line expression of at most ``RETURN_CHARS`` characters; not a
              function's local name); a hit holds the expression
    default   a function's only parameter with a default (a one-line expression of at most
              ``RETURN_CHARS`` characters); a hit holds it
    params    a function of 2 to 6 parameters (``self`` and ``cls`` aside), each named by at
              least 2 characters; a hit names every one
    within    a line of a function's own body (not a nested one's, not its docstring), of
              ``LINE_CHARS`` characters, where a statement starts, found once in the source
              and not naming the function, quoted; a hit names the function. The function is
              at most ``WITHIN_LINES`` lines long; the line asked about is the middle one of
              those that qualify. The question shares the line's words; its answer is on
              another line (the ``def``)
    natural   the four kinds asked of real code as it is (``NATURAL``: assign, default, params,
              within), one after another, the same number of each (give or take one): what a
              reader is trained on to answer all four (each example's ``meta["variant"]`` says
              its kind)

Nothing is asked whose answer is guessed without reading (``None``, ``True``, ``False``, a
single character).

A name defined twice in the source is never asked about. The document is the lines around it in
the source, the function or class starting at ``depth`` of the document. Sources and tokens as
``ktm.tasks.needle``'s; a source must be Python (``stdlib``, ``code``, or a folder of .py
files).
"""

from __future__ import annotations

import ast
import random
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from ktm.errors import KTMError
from ktm.tasks import haystack
from ktm.tasks.base import Example, PromptMode, TaskKind, qa_prompt
from ktm.tasks.questions import QuestionTask

RETURN_CHARS = 40
LINE_CHARS = (20, 80)  # the shortest and longest line (spaces at its ends aside) ``within`` quotes
WITHIN_LINES = 30  # the longest function ``within`` asks about, in lines
NATURAL = ("assign", "default", "params", "within")  # the kinds ``natural`` takes in turn


@dataclass(frozen=True)
class Target:
    """A function or class asked about: its lines in the source, the question's name, the
    answers."""

    first: int  # index of its first line in ``haystack.lines_of(source)``
    last: int  # index after its last line
    name: str
    answers: tuple[str, ...]
    about: str = ""  # default: the parameter asked about; within: the line


@lru_cache(maxsize=8)
def targets(source: str, variant: str, train: bool) -> tuple[Target, ...]:
    """Every function (``returns``) or class (``methods``) of the source's modules that a
    question can be asked about (module docstring), in source order."""
    found, names, offset = [], Counter(), 0
    seen = Counter(line.strip() for text in haystack.texts(source, train)
                   for line in text.splitlines()) if variant == "within" else Counter()
    for text in haystack.texts(source, train):
        lines = text.splitlines(keepends=True)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):  # not Python (or not this Python's): nothing to ask
            offset += len(lines) + 1
            continue
        # a function's own names are not asked about (``assign``)
        local = {id(n) for f in ast.walk(tree) if variant == "assign"
                 and isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                 for n in ast.walk(f) if isinstance(n, ast.Assign)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] += 1
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            got = None if id(node) in local else _answers(node, text, variant, seen)
            if got:
                name, answers, about = got
                first = min([node.lineno, *(d.lineno for d in
                                            getattr(node, "decorator_list", ()))]) - 1
                found.append(Target(offset + first, offset + node.end_lineno, name, answers,
                                    about))
        offset += len(lines) + 1  # lines_of puts a blank line after every text
    return tuple(t for t in found if names[t.name] == 1 and not t.name.startswith("_"))


def _answers(node, text: str, variant: str, seen: Counter
             ) -> tuple[str, tuple[str, ...], str] | None:
    """(the name asked about, the answers, what else the question names: the parameter or the
    line) of a node a ``variant`` question can be asked about; None for any other. ``seen``:
    how often each stripped line occurs in the source (``within``)."""
    function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    if variant == "returns" and function:
        returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
        last = node.body[-1]
        if len(returns) == 1 and returns[0] is last and last.value is not None:
            expr = _expression(text, last.value)
            if expr:
                return node.name, (expr,), ""
    if variant == "methods" and isinstance(node, ast.ClassDef):
        methods = [n.name for n in node.body
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and not (n.name.startswith("__") and n.name.endswith("__"))]
        if 2 <= len(methods) <= 6 and node.end_lineno - node.lineno < 80:
            return node.name, tuple(methods), ""
    if (variant == "assign" and isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)):
        expr = _expression(text, node.value)
        if expr and _unguessable(expr):
            return node.targets[0].id, (expr,), ""
    if variant == "default" and function:
        args = node.args
        params = [*args.posonlyargs, *args.args][-len(args.defaults):] if args.defaults else []
        pairs = [(a.arg, d) for a, d in zip(params, args.defaults)]
        pairs += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
        if len(pairs) == 1:
            expr = _expression(text, pairs[0][1])
            if expr and _unguessable(expr):
                return node.name, (expr,), pairs[0][0]
    if variant == "params" and function:
        args = node.args
        names = [a.arg for a in (*args.posonlyargs, *args.args, args.vararg, *args.kwonlyargs,
                                 args.kwarg) if a is not None and a.arg not in ("self", "cls")]
        if 2 <= len(names) <= 6 and all(len(n) > 1 for n in names):
            return node.name, tuple(names), ""
    if variant == "within" and function and node.end_lineno - node.lineno < WITHIN_LINES:
        line = _own_line(node, text, seen)
        if line:
            return node.name, (node.name,), line
    return None


def _own_line(node, text: str, seen: Counter) -> str:
    """The middle of a function's own body lines a ``within`` question can quote, or ''."""
    body = node.body
    if (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]  # the docstring
    if not body:
        return ""
    nested = {n for inner in ast.walk(node) if inner is not node and isinstance(
        inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
        for n in range(inner.lineno, inner.end_lineno + 1)}
    starts = {n.lineno for n in ast.walk(node) if isinstance(n, ast.stmt)}
    lines = text.splitlines()
    ok = [s for i in range(body[0].lineno, node.end_lineno + 1) if i in starts - nested
          for s in [lines[i - 1].strip()]
          if LINE_CHARS[0] <= len(s) <= LINE_CHARS[1] and seen[s] == 1 and node.name not in s]
    return ok[len(ok) // 2] if ok else ""


def _expression(text: str, node) -> str:
    """The source of an expression when it is one line of at most ``RETURN_CHARS``, else ''."""
    expr = ast.get_source_segment(text, node) or ""
    return expr if 0 < len(expr) <= RETURN_CHARS and "\n" not in expr else ""


def _unguessable(expr: str) -> bool:
    return len(expr) > 1 and expr not in ("None", "True", "False")


@dataclass
class CodeQATask(QuestionTask):
    """Questions about a function or class in a long stretch of code (module docstring)."""

    prompt_mode: PromptMode = "context"
    length: int = 1024
    variant: Literal["returns", "methods", "assign", "default", "params", "within",
                     "natural"] = "returns"
    depth: float | None = None  # None: spread evenly over [0, 1] across the examples
    source: str = "stdlib"
    train_source: str = "code"
    name: str = field(default="codeqa", init=False)
    kind: TaskKind = field(default="qa", init=False)
    labels: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        if self.length < 64:
            raise KTMError(f"codeqa length must be >= 64 tokens, got {self.length}")

    @property
    def answer_tokens(self) -> int:
        return 40 if self.variant in ("methods", "params", "natural") else 24

    def _examples(self, n: int, seed: int, train: bool) -> list[Example]:
        if self.variant != "natural":
            return self._kind_examples(self.variant, n, seed, train)
        # each kind's examples as that kind alone draws them, dealt out in turn
        kinds = [self._kind_examples(kind, len(range(i, n, len(NATURAL))), seed, train)
                 for i, kind in enumerate(NATURAL)]
        return [kinds[i % len(NATURAL)][i // len(NATURAL)] for i in range(n)]

    def _kind_examples(self, variant: str, n: int, seed: int, train: bool) -> list[Example]:
        self.tokens()  # bound, or an error saying so
        if n == 0:
            return []
        source = self.train_source if train else self.source
        lines = haystack.lines_of(source, train)
        rng = random.Random(f"codeqa:{seed}:{train}:{variant}")
        pool = [t for t in targets(source, variant, train)
                if self._tokens.count("".join(lines[t.first:t.last])) <= self.length // 2]
        if not pool:
            raise KTMError(f"source {source!r} has no {variant} question to ask in "
                           f"{self.length} tokens: expected Python code (stdlib, code or a "
                           "folder of .py files) or a longer length")
        picks = [pool[i % len(pool)] for i in rng.sample(range(len(pool)), min(n, len(pool)))]
        picks += [rng.choice(pool) for _ in range(n - len(picks))]
        return [self._example(lines, variant, t, d)
                for t, d in zip(picks, haystack.depths(n, self.depth))]

    def _example(self, lines, variant: str, target: Target, depth: float) -> Example:
        count = self._tokens.count
        body = count("".join(lines[target.first:target.last]))
        want = round(depth * (self.length - body))  # tokens before the target
        # lines around it, by the lines' own counts (at least their joined count), then the
        # joined text counted once at every line boundary
        a, got = target.first, 0
        while a > 0 and got < want + want // 4 + 8:
            a, got = a - 1, got + count(lines[a - 1])
        b, got = target.last, 0
        while b < len(lines) and got < self.length + self.length // 4 + 8:
            b, got = b + 1, got + count(lines[b])
        ends = [0]
        for line in lines[a:b]:
            ends.append(ends[-1] + len(line))
        at = self._tokens.before("".join(lines[a:b]), ends)
        head, tail = target.first - a, target.last - a  # the target's boundaries
        start = min(i for i in range(head + 1) if at[head] - at[i] <= want)
        end = max(j for j in range(tail, len(at)) if j == tail or at[j] - at[start] <= self.length)
        first, last = a + start, a + end
        used, total = at[head] - at[start], at[end] - at[start]
        doc = "".join(lines[first:last])
        if variant == "returns":
            question = (f"\nQuestion: what does the function {target.name} return? Answer: "
                        f"{target.name} returns")
            target_text = f" {target.answers[0]}"
        elif variant == "methods":
            question = (f"\nQuestion: which methods does the class {target.name} define? "
                        f"Answer: The class {target.name} defines")
            target_text = " " + ", ".join(target.answers) + "."
        elif variant == "assign":
            question = f"\nQuestion: what is {target.name} set to? Answer: {target.name} ="
            target_text = f" {target.answers[0]}"
        elif variant == "params":
            question = (f"\nQuestion: which parameters does the function {target.name} take? "
                        f"Answer: def {target.name}(")
            target_text = ", ".join(target.answers) + "):"
        elif variant == "within":
            question = (f"\nQuestion: which function is the line `{target.about}` in? Answer: "
                        "It is in the function")
            target_text = f" {target.name}"
        else:
            question = (f"\nQuestion: what is the default value of the parameter "
                        f"{target.about} of the function {target.name}? Answer: The default "
                        f"value of {target.about} is")
            target_text = f" {target.answers[0]}"
        return Example(qa_prompt(doc, question, self.prompt_mode), target_text,
                       meta={"answers": list(target.answers), "depth": used / max(1, total),
                             "tokens": total, "variant": variant})
