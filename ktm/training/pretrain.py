"""Reader pretraining: teach the encoder and LoRA to read merged text, with no labels.

Every example is a window of unlabeled text (``ktm.tasks.corpus``) whose context is merged, trained
with one of these objectives (alone or mixed by weight):

    lm       cross-entropy on the plain continuation after the merged context
    distill  self-distillation on that continuation: the teacher is the same base LM with its
             adapter disabled reading the *plain* context (PEFT's adapter-disabled forward, so no
             second model in memory); KL(teacher || student) per continuation token, plus
             (``distill_hidden`` > 0) the squared distance between the student's and the
             teacher's hidden states there, every layer, relative to the teacher's norm: if the
             merged context carries what the plain one does, those states can match, and that
             is far more signal per token than the output distribution alone
    ae       autoencoding (ICAE): after the merged context and a plain cue, regenerate the
             context itself. This is the objective that forces every token to survive.
    answer   a question asked in a chat, as ``ktm serve`` reads one: one user message, the
             context and then a question quoting ``RECALL_CUE`` of its tokens; the target is
             the base LM's own greedy answer reading that chat plain (adapter disabled, up to
             ``ANSWER_TOKENS`` and its end-of-turn), the loss KL(teacher || student) per answer
             token: the reader learns to answer a chat about a merged document as the base
             answers it read plain, in its form and its focus (needs ``chat``)
    recall   a question drawn from the context: ``RECALL_CUE`` of its tokens from a random
             place, given plain after the merged context, and the tokens that followed them
             there as the target (recall R's reading, ``ktm.tasks.corpus.recall_question``). A
             mixed window (``mixed_share``) laid out by the ``question`` signal reads the
             cue's lines plain: a reader learns to answer from a plain island in a merged
             document, as the question allocator reads one
    align    ``lm`` plus context alignment: at every position of the merged context, each
             layer's hidden state is pulled (squared distance relative to the teacher's norm,
             weight ``align_weight``) towards the base LM's (adapter disabled) reading the
             plain context, at the last token the position stands for: the state the plain
             reading has there, over exactly the same tokens. The continuation then attends to
             states like the plain reading's at every K-th token. Position 0, the attention
             sink, is left out: its states are outliers that would swamp the scale.

A K mix (``k_mix``) gives each window a K drawn by weight from the model's merge levels: its
own K and, for a recursive encoder (``inner_k``), its inner K. One LoRA then learns to read
both, and the checkpoint loads at either (``KTMModel.load(..., k=inner_k)``).

The run is an ordinary ``ktm.training.train`` run (progress bar, metrics.jsonl, atomic checkpoints,
exact resume); the window stream is a pure function of (seed, index), so a resumed run sees the same
windows. Every ``eval_every`` steps it logs the readability R on held-out text.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

from ktm.core.allocate import max_ratio, quiet_ratio
from ktm.core.batch import LossOutput
from ktm.core.config import Layout, check_ratio
from ktm.core.levels import encoder_at, merges, merging_at
from ktm.core.loss import check_fits, target_ids, target_logits
from ktm.core.prompt import Segment
from ktm.core.signals import SIGNALS
from ktm.errors import KTMError
from ktm.tasks.base import Example
from ktm.tasks.corpus import (
    HELDOUT,
    WindowSpec,
    autoencode_window,
    check_docs,
    continuation_window,
    is_source,
    recall_question,
    source_texts,
    tokenize_docs,
)
from ktm.training import distributed
from ktm.training.config import TrainConfig
from ktm.training.teacher import kl_per_token
from ktm.training.train import train
from ktm.util.field_types import check_field_types

OBJECTIVES = ("lm", "distill", "ae", "align", "recall", "answer")
# the longest teacher answer an ``answer`` window distils
ANSWER_TOKENS = 32


def parse_weights(specs: Sequence[str], what: str, allowed: Sequence[str] | None = None,
                  known: Callable[[str], bool] | None = None) -> dict[str, float]:
    """``["code", "reviews=0.5"]`` -> ``{"code": 1.0, "reviews": 0.5}``. A spec that ``known``
    takes whole while it does not take the part before its last "=" is a name by itself: a
    folder ``runs/lr=1e-3`` is not the source ``runs/lr`` at weight 0.001."""
    out: dict[str, float] = {}
    for spec in specs:
        name, _, w = spec.rpartition("=") if "=" in spec else (spec, "", "1")
        if known is not None and "=" in spec and known(spec) and not known(name):
            name, w = spec, "1"
        try:
            weight = float(w)
        except ValueError:
            raise KTMError(f"{what} {spec!r}: weight {w!r} is not a number") from None
        if not math.isfinite(weight) or weight < 0:
            raise KTMError(f"{what} {spec!r}: weight must be a finite number >= 0, got {w!r}")
        if not name:
            raise KTMError(f"{what} {spec!r} has no name: expected NAME or NAME=WEIGHT")
        if allowed is not None and name not in allowed:
            raise KTMError(f"unknown {what} {name!r}: expected one of {', '.join(allowed)}")
        out[name] = out.get(name, 0.0) + weight
    if not out or sum(out.values()) <= 0:
        raise KTMError(f"no {what} with a positive weight: expected at least one")
    return out


@dataclass
class PretrainConfig:
    """What a reader pretrains on (``pretrain``, ``ktm pretrain``): text sources, objectives and
    window lengths, the K mix, and the held-out sets for readability R. Raises ``KTMError`` on
    construction for an unknown objective or held-out set, a bad weight or an out-of-range
    length."""

    sources: tuple[str, ...] = field(default=("code", "reviews"), metadata={
        "help": "text sources, each NAME or NAME=WEIGHT: code, reviews, trees[:STAGE,...], "
                "or a text/JSONL file or folder"})
    objectives: tuple[str, ...] = field(default=("lm",), metadata={
        "help": "objectives, each NAME or NAME=WEIGHT: lm, distill, ae, align, recall, answer"})
    objective_mix: str = field(default="example", metadata={
        "help": "how objectives mix: example (each window draws one by weight) or step (every "
                "window of an optimizer step shares one drawn by weight: ARC-Encoder's "
                "alternation of reconstruction and continuation)"})
    context_tokens: int = field(default=256, metadata={"help": "longest merged context"})
    answer_context_tokens: int = field(default=0, metadata={
        "help": "longest merged context of an answer window, a document as long as users "
                "paste into a chat (0: --context-tokens)"})
    target_tokens: int = field(default=64, metadata={"help": "longest continuation target"})
    ae_tokens: int = field(default=128, metadata={"help": "longest context to autoencode"})
    min_tokens: int = field(default=32, metadata={"help": "shortest usable text, in tokens"})
    distill_hidden: float = field(default=0.0, metadata={
        "help": "weight of hidden-state matching added to the distill objective"})
    align_weight: float = field(default=1.0, metadata={
        "help": "weight of the context alignment added to the align objective's cross-entropy"})
    ae_cue: str = field(default="\nRepeat the text above:\n",
                        metadata={"help": "plain text between the merged context and its copy"})
    k_mix: tuple[str, ...] = field(default=(), metadata={
        "help": "a K mix, each K or K=WEIGHT, from the model's K and its inner K (--inner-k): "
                "one LoRA learns to read each (none: the model's K only)"})
    mixed_share: float = field(default=0.0, metadata={
        "help": "adaptive merging: the share of windows whose context is read at a ratio drawn "
                "log-uniformly from --ratio-range, its positions spent by a signal drawn from "
                "--mixed-signals, so one reader learns to read any mix of levels (the others "
                "are merged at the model's K, or the K mix's)"})
    ratio_range: tuple[float, ...] = field(default=(1.5, 8.0), metadata={
        "help": "the lowest and highest ratio of a mixed window"})
    mixed_signals: tuple[str, ...] = field(default=("random", "rules", "surprisal", "recency",
                                                    "even"), metadata={
        "help": "the allocators a mixed window's layout is drawn from, each NAME or NAME=WEIGHT "
                "(surprisal: the table pretraining builds from its own text)"})
    eval_ratios: tuple[float, ...] = field(default=(), metadata={
        "help": "readability R also with the held-out contexts read at these ratios "
                "(logged as SET@rRATIO)"})
    press: str | None = field(default=None, metadata={
        "help": "a KV press read in training (kvpress, names as ktm generate --press): the "
                "windows --press-share draws read the merged context's KV pressed, so the "
                "reader learns to be read stacked (lm and ae windows; none: no press)"})
    press_ratio: float = field(default=0.5, metadata={
        "help": "--press: the share of the merged context's KV dropped, in [0, 1)"})
    press_share: float = field(default=0.5, metadata={
        "help": "--press: the share of lm and ae windows read pressed"})
    chat_share: float = field(default=0.0, metadata={
        "help": "the share of lm, ae and recall windows read as a chat, as ktm serve reads "
                "one: lm and ae as a long chat (--history-budget), the context split into 2 to "
                "6 messages of alternating roles in the model's chat template, the oldest "
                "merged and the rest plain, then a plain request to continue the text (lm) or "
                "to repeat one merged message (ae); recall as one user message, the document "
                "and then a question quoting the cue, answered as the assistant"})
    text_field: str = field(default="text", metadata={"help": "JSONL field of user texts"})
    eval_sets: tuple[str, ...] = field(default=("reviews", "code"), metadata={
        "help": "held-out sets for the periodic readability R (none: skip)"})
    n_eval_windows: int = field(default=32, metadata={"help": "held-out windows per set"})

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("sources", "objectives", "k_mix", "eval_sets", "mixed_signals",
                     "ratio_range", "eval_ratios"):
            value = getattr(self, name)
            # one name is one item: tuple("code") would be the sources c, o, d, e
            setattr(self, name, (value,) if isinstance(value, (str, int)) else tuple(value))
        self.eval_sets = tuple(s for s in self.eval_sets if s != "none")
        self.source_weights = parse_weights(self.sources, "text source", known=is_source)
        self.objective_weights = parse_weights(self.objectives, "objective", OBJECTIVES)
        if self.objective_mix not in ("example", "step"):
            raise KTMError(f"objective_mix must be example or step, got {self.objective_mix!r}")
        self.k_mix = tuple(str(k) for k in self.k_mix)
        self.k_weights = {_k_value(k): w for k, w in parse_weights(self.k_mix, "K").items()
                          if w > 0} if self.k_mix else {}
        self.window = WindowSpec(self.context_tokens, self.target_tokens, self.ae_tokens,
                                 self.min_tokens)
        if self.answer_context_tokens < 0:
            raise KTMError(f"answer_context_tokens must be >= 0 (0: context_tokens), got "
                           f"{self.answer_context_tokens}")
        if not 0.0 <= self.mixed_share <= 1.0:
            raise KTMError(f"mixed_share must be in [0, 1], got {self.mixed_share!r}")
        if len(self.ratio_range) != 2:
            raise KTMError(f"ratio_range must be two ratios (lowest, highest), got "
                           f"{list(self.ratio_range)}")
        low, high = (check_ratio(r, "a ratio_range end") for r in self.ratio_range)
        if low > high:
            raise KTMError(f"ratio_range {list(self.ratio_range)}: expected lowest <= highest")
        self.ratio_range = (low, high)
        self.eval_ratios = tuple(check_ratio(r, "an eval ratio") for r in self.eval_ratios)
        if self.press is not None:
            from ktm.decode.press import PressConfig

            PressConfig(self.press, self.press_ratio)  # an unknown name or a bad ratio, now
        if not 0.0 <= self.press_share <= 1.0:
            raise KTMError(f"press_share must be in [0, 1], got {self.press_share!r}")
        if not 0.0 <= self.chat_share <= 1.0:
            raise KTMError(f"chat_share must be in [0, 1], got {self.chat_share!r}")
        self.signal_weights = parse_weights(self.mixed_signals, "allocator", tuple(SIGNALS))
        for name in ("distill_hidden", "align_weight"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise KTMError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        unknown = [s for s in self.eval_sets if s not in HELDOUT]
        if unknown:  # else the first evaluation, after training, would fail
            raise KTMError(f"unknown held-out set {unknown[0]!r} in eval_sets: expected "
                           f"{', '.join(HELDOUT)} or none")
        if self.n_eval_windows < 1:
            raise KTMError(f"n_eval_windows must be >= 1, got {self.n_eval_windows}")

    def window_of(self, objective: str) -> WindowSpec:
        """How an ``objective``'s windows are cut: answer windows at their own context length
        (``answer_context_tokens``), every other objective's at ``window``."""
        if objective == "answer" and self.answer_context_tokens:
            return replace(self.window, context_tokens=self.answer_context_tokens)
        return self.window

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items()}


def _k_value(name: str) -> int:
    try:
        k = int(name)
    except ValueError:
        raise KTMError(f"K {name!r} in the K mix is not an integer: expected e.g. 2 or 4=0.5"
                       ) from None
    if k < 1:
        raise KTMError(f"K {k} in the K mix must be >= 1")
    return k


class WindowStream(Sequence):
    """``length`` pretraining examples; example i depends only on (seed, i), never on length."""

    is_stream = True  # ktm.training.train reads it in index order

    def __init__(self, docs: dict[str, list], cfg: PretrainConfig, length: int, seed: int,
                 eos: int | None, lead: Sequence[int] = (), per_step: int = 1,
                 top_k: int = 1, plain: int = 0, chat: Callable | None = None):
        self.docs, self.cfg, self.length, self.seed, self.eos = docs, cfg, length, seed, eos
        # chat_share: (ids -> text, messages -> segments): the model's tokenizer, and how
        # ``ktm serve`` reads a chat (``chat_window``)
        self.chat = chat
        if (cfg.chat_share > 0 or cfg.objective_weights.get("answer", 0) > 0) and chat is None:
            raise KTMError("chat_share > 0 and the answer objective need the model's tokenizer "
                           "and chat template: expected chat=(decode, chat_prompt)")
        # windows per optimizer step (all processes'): objective_mix="step" draws one objective
        # for each run of per_step consecutive windows
        self.per_step = per_step
        self.lead = tuple(lead)  # the tokenizer's BOS, if it adds one (KTMModel.lead_ids)
        # a mixed window's ratio stays within what its context allows: every unit at the
        # model's largest K, its plain prefix and suffix (``plain`` tokens) plain
        self.top_k, self.plain = top_k, plain
        self.sources = [s for s in cfg.source_weights if cfg.source_weights[s] > 0]
        self.src_w = [cfg.source_weights[s] for s in self.sources]
        self.objs = [o for o in cfg.objective_weights if cfg.objective_weights[o] > 0]
        self.obj_w = [cfg.objective_weights[o] for o in self.objs]
        self.ks, self.k_w = list(cfg.k_weights), list(cfg.k_weights.values())
        w = cfg.window
        # what example i is drawn from, beyond (seed, i): a resume must keep it (ktm.training.state)
        self.signature = {
            "sources": dict(cfg.source_weights), "objectives": dict(cfg.objective_weights),
            "k_mix": {str(k): v for k, v in cfg.k_weights.items()},
            "windows": [w.context_tokens, w.target_tokens, w.ae_tokens, w.min_tokens],
            "text_field": cfg.text_field, "ae_cue": cfg.ae_cue,
            "docs": {name: len(d) for name, d in docs.items()}}
        if cfg.objective_mix == "step":  # only then: an older run's signature stays as it was
            self.signature["objective_mix"] = ["step", per_step]
        self.signals = [g for g, w in cfg.signal_weights.items() if w > 0]
        self.signal_w = [cfg.signal_weights[g] for g in self.signals]
        if cfg.mixed_share > 0:  # likewise
            self.signature["mixed"] = [cfg.mixed_share, list(cfg.ratio_range),
                                       dict(cfg.signal_weights)]
        if cfg.press is not None:  # likewise
            self.signature["press"] = [cfg.press, cfg.press_ratio, cfg.press_share]
        if cfg.chat_share > 0:  # likewise
            self.signature["chat"] = cfg.chat_share
        if cfg.answer_context_tokens:  # likewise
            self.signature["answer_context"] = cfg.answer_context_tokens

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i):  # type: ignore[override]
        if not 0 <= i < self.length:
            raise IndexError(i)
        rng = random.Random(self.seed * 1_000_003 + i)
        source = rng.choices(self.sources, self.src_w)[0]
        objective = rng.choices(self.objs, self.obj_w)[0]
        if self.cfg.objective_mix == "step":  # drawn apart, so the window draws stay the same
            step = random.Random(f"{self.seed}:step:{i // self.per_step}")
            objective = step.choices(self.objs, self.obj_w)[0]
        doc = rng.choice(self.docs[source])
        spec = self.cfg.window_of(objective)
        if objective == "ae":
            w = autoencode_window(doc, spec, rng, source)
            target = w.target + ((self.eos,) if self.eos is not None else ())
            segments = (Segment("", ids=self.lead + w.context),
                        Segment(self.cfg.ae_cue, compress=False))
        elif objective in ("recall", "answer"):
            w = continuation_window(doc, spec, rng, source)
            cue, target = recall_question(w, rng.randrange(2 ** 31))
            segments = (Segment("", ids=self.lead + w.context),
                        Segment("", compress=False, ids=cue))
        else:
            w = continuation_window(doc, spec, rng, source)
            target = w.target
            segments = (Segment("", ids=self.lead + w.context),)
        meta = {"objective": objective, "source": source}
        if self.ks:  # drawn last, so that a run without a K mix keeps its windows
            meta["k"] = rng.choices(self.ks, self.k_w)[0]
        if self.cfg.mixed_share > 0 and rng.random() < self.cfg.mixed_share:  # likewise
            low, high = self.cfg.ratio_range
            ratio = math.exp(rng.uniform(math.log(low), math.log(high)))
            n = len(segments[0].ids)
            ratio = max(1.0, min(ratio, max_ratio(n, min(self.plain, n), self.top_k)))
            meta.pop("k", None)  # read at the model's own levels, all of them
            meta["signal"] = rng.choices(self.signals, self.signal_w)[0]
            segments = (Segment("", ids=segments[0].ids, ratio=ratio), *segments[1:])
        if (self.cfg.press is not None and objective in ("lm", "ae")  # drawn last: likewise
                and rng.random() < self.cfg.press_share):
            meta["press"] = True
        if (self.cfg.chat_share > 0 and objective in ("lm", "ae") and "signal" not in meta
                and rng.random() < self.cfg.chat_share):  # likewise
            segments, target = chat_window(w, objective, rng, *self.chat, self.eos)
            meta["chat"] = True
        elif objective == "answer":  # always a chat; its target is the teacher's, in the loss
            segments = chat_question(self.chat[0](list(w.context)), self.chat[0](list(cue)),
                                     segments[0].ratio, rng, self.chat[1], ANSWER_ASKS)
        elif (self.cfg.chat_share > 0 and objective == "recall"
                and rng.random() < self.cfg.chat_share):  # likewise
            segments = chat_question(self.chat[0](list(w.context)), self.chat[0](list(cue)),
                                     segments[0].ratio, rng, self.chat[1])
            meta["chat"] = True
        return Example(segments, target, meta=meta)


ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth")


def chat_window(w, objective: str, rng: random.Random, decode: Callable, chat: Callable,
                eos: int | None) -> tuple[tuple[Segment, ...], tuple[int, ...]]:
    """Window ``w``'s context as a chat (``PretrainConfig.chat_share``): split at random into 2
    to 6 messages (at least 8 tokens each) of alternating roles, user first, read through the
    model's chat template (``chat``: messages -> segments, ``ktm.chat_prompt``); the oldest 1 to
    all of them merged, the rest plain, as ``ktm serve`` reads a chat over its history budget.
    A last user message, plain, asks to continue the text (lm: the target is the window's
    continuation) or to repeat one merged message word for word (ae: that message's tokens,
    then EOS)."""
    ids, units = list(w.context), len(w.context) // 8
    most = max(1, min(len(ORDINALS), units))  # a context under 16 tokens: one message
    n = rng.randint(min(2, most), most)
    bounds = [0, *(8 * c for c in sorted(rng.sample(range(1, units), n - 1))), len(ids)]
    parts = [ids[a:b] for a, b in zip(bounds, bounds[1:])]
    merged = rng.randint(1, n)
    messages = [{"role": ("user", "assistant")[i % 2], "content": decode(part),
                 **({} if i < merged else {"ktm": {"merge": False}})}
                for i, part in enumerate(parts)]
    if objective == "ae":
        j = rng.randrange(merged)
        ask, target = (f"Repeat the {ORDINALS[j]} message of this chat word for word.",
                       tuple(parts[j]) + ((eos,) if eos is not None else ()))
    else:
        ask, target = "Continue the text where the last message stops.", tuple(w.target)
    if messages[-1]["role"] == "user":  # roles alternate: an assistant turn between
        messages.append({"role": "assistant", "content": "Noted.", "ktm": {"merge": False}})
    messages.append({"role": "user", "content": ask, "ktm": {"merge": False}})
    return tuple(chat(messages)), target


# how a chat asks a recall question: the copied tokens quoted, the answer what follows them
CHAT_ASKS = ('What comes right after "{cue}" in the text above?',
             'Continue the text above from "{cue}".',
             'In the text above, which words follow "{cue}"?')


# how an ``answer`` window asks: as a user asks about a pasted text, the answer left to the teacher
ANSWER_ASKS = (*CHAT_ASKS,
               'Quote the line of the text above that has "{cue}" in it.',
               'What does the text above say about "{cue}"?',
               'Where does the text above mention "{cue}", and what does it say there?',
               'Explain the part of the text above that reads "{cue}".')


def chat_question(document: str, cue: str, ratio: float | None, rng: random.Random,
                  chat: Callable, asks: Sequence[str] = CHAT_ASKS) -> tuple[Segment, ...]:
    """A recall window as a user asks about a document in ``ktm serve``'s chat: one user
    message, the document and then a question quoting ``cue``, read through the model's chat
    template (``chat``: messages -> segments, ``ktm.chat_prompt``), which splits the question
    off and reads it plain (``ktm.core.question.split_question``). The target stays the tokens
    after the cue, answered as the assistant's turn. ``ratio``: the merged document's (a mixed
    window's), None: the reader's own. The cue is quoted on one line, its whitespace runs as
    single spaces, as a user would type it: a question of one line is split off whole."""
    ask = rng.choice(asks).format(cue=" ".join(cue.split()))
    segments = tuple(chat([{"role": "user", "content": f"{document}\n{ask}"}]))
    if ratio is None:
        return segments
    return tuple(replace(s, ratio=ratio) if s.compress else s for s in segments)


def check_window_positions(model, cfg: PretrainConfig) -> None:
    """Refuse windows of ``cfg``'s sizes that the model's positions cannot hold, before any
    step: only the longest documents give full windows, and the first step to draw one would
    fail mid-run. distill and align also read the context plain (the teacher)."""
    spec, objs = cfg.window, [o for o, w in cfg.objective_weights.items() if w > 0]
    plain = model.config.plain_prefix + model.config.plain_suffix
    def context(obj: str) -> int:
        w = cfg.window_of(obj)
        return w.ae_tokens if obj == "ae" else w.context_tokens

    longest = len(model.lead_ids) + max(context(o) for o in objs)
    if plain >= longest:  # the run would train a reader on plain text only
        raise KTMError(f"plain_prefix + plain_suffix = {plain} keep every token of the longest "
                       f"window context ({longest} tokens) plain: nothing would be merged; "
                       "expected fewer plain tokens or longer windows (--context-tokens)")
    if not model.max_positions:
        return
    filler = model.tokenizer("a", add_special_tokens=False)["input_ids"][:1] or [0]
    k = min(cfg.k_weights or (model.k,))  # the smallest K gives the longest prefix
    # a mixed window below that K's ratio is read with more positions: the plain reading bounds it
    plain_too = cfg.mixed_share > 0 and cfg.ratio_range[0] < k
    for obj in objs:
        n_ctx = context(obj)
        segments = [Segment("", ids=tuple(model.lead_ids) + tuple(filler) * n_ctx)]
        if obj == "ae":
            segments.append(Segment(cfg.ae_cue, compress=False))
        n_target = (spec.ae_tokens + (model.eos_id is not None) if obj == "ae"
                    else spec.target_tokens)
        try:
            with merging_at(model, k):
                for merge in ((True, False) if obj in ("distill", "align", "answer") or plain_too
                              else (True,)):
                    check_fits(model, model.encode_prompts([segments], merge), [n_target],
                               "target tokens")
        except KTMError as e:
            flags = ("--ae-tokens" if obj == "ae" else "--answer-context-tokens / --target-tokens"
                     if obj == "answer" and cfg.answer_context_tokens
                     else "--context-tokens / --target-tokens")
            raise KTMError(f"a full {obj} window does not fit this model's positions ({e}): "
                           f"expected smaller windows ({flags})") from None


def load_docs(tokenizer, cfg: PretrainConfig) -> dict[str, list]:
    docs = {}
    for spec in cfg.source_weights:
        texts = source_texts(spec, cfg.text_field)
        docs[spec] = tokenize_docs(tokenizer, texts, cfg.min_tokens, desc=f"tokenize {spec}")
        check_docs(docs[spec], len(texts), spec, cfg.min_tokens)
    return docs


@contextmanager
def as_base(model):
    """The teacher's reading: the base LM itself (adapter disabled, eval mode, no gradient),
    the student's training mode restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), model.peft.disable_adapter():
            yield model
    finally:
        model.train(was_training)


def teacher_logits(model, batch: Sequence[Example], hidden: bool = False):
    """The base LM (adapter disabled, eval mode) reading each example's context plain."""
    with as_base(model):
        return target_logits(model, [e.segments for e in batch], [e.target for e in batch],
                             merge=False, hidden=hidden)


def teacher_answers(model, batch: Sequence[Example]) -> list[Example]:
    """``batch`` (``answer`` windows) with each target the base LM's greedy answer (adapter
    disabled) reading its chat plain: up to ``ANSWER_TOKENS`` tokens, through the end-of-turn
    id that ends it, so the reader also learns where an answer stops."""
    from ktm.decode.generate import generate_ids

    with as_base(model):
        rows = generate_ids(model, [e.segments for e in batch], merge=False,
                            max_new_tokens=ANSWER_TOKENS, stop_at_eos=False)
    out = []
    for e, row in zip(batch, rows):
        end = next((i for i, t in enumerate(row) if t in model.eos_ids), len(row) - 1)
        out.append(replace(e, target=tuple(row[:end + 1])))
    return out


def _hidden_gap(student: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, ...]
                ) -> torch.Tensor:
    """Per-token squared distance of hidden states relative to the teacher's squared norm at
    that token and layer, averaged over layers: (N,). Each token's gap is its own, so a batch's
    losses are its examples' one by one (and several processes equal one)."""
    gaps = [((s.float() - t.float()) ** 2).sum(-1) / (t.float() ** 2).sum(-1).clamp(min=1e-12)
            for s, t in zip(student, teacher)]
    return torch.stack(gaps).mean(0)


def _context_gap(model, batch: Sequence[Example], prefixes, student: tuple[torch.Tensor, ...]
                 ) -> torch.Tensor:
    """Per example: the mean hidden-state gap (``_hidden_gap``) over its merged context's
    positions, each against the teacher's (the base LM reading the plain context) at the last
    token it stands for; position 0 (the attention sink) left out: (B,)."""
    with as_base(model):
        plain = model.encode_prompts([e.segments for e in batch], merge=False)
        first = [e.target[:1] for e in batch]  # the teacher's states at the prompt only
        teacher = target_logits(model, [e.segments for e in batch], first, prefixes=plain,
                                prompt_hidden=True).prompt_hidden
    t_idx, s_idx, rows = [], [], []
    t_off = s_off = 0
    for i, (cp, tp) in enumerate(zip(prefixes, plain)):
        if cp.tokens_in != tp.tokens_out:
            raise KTMError(f"merged prompt {i} stands for {cp.tokens_in} tokens, its plain "
                           f"reading has {tp.tokens_out}: expected the same tokens")
        keep = (cp.sources > 0).nonzero().squeeze(1)  # every position but the sink
        s_idx.append(s_off + keep)
        t_idx.append(t_off + cp.sources[keep])
        rows.append(torch.full_like(keep, i))
        s_off += cp.tokens_out
        t_off += tp.tokens_out
    dev = model.device
    s_idx, t_idx, rows = (torch.cat(v).to(dev) for v in (s_idx, t_idx, rows))
    gap = _hidden_gap(tuple(h[s_idx] for h in student), tuple(h[t_idx] for h in teacher))
    total = gap.new_zeros(len(batch)).index_add(0, rows, gap)
    count = gap.new_zeros(len(batch)).index_add(0, rows, torch.ones_like(gap))
    return total / count.clamp(min=1)


def pretrain_loss(model, batch: Sequence[Example], distill_hidden: float = 0.0,
                  align_weight: float = 1.0, press=None) -> LossOutput:
    """Each example's objective: CE for lm/ae (one forward), KL to the teacher for distill
    (plus ``distill_hidden`` times the hidden-state gap), CE plus ``align_weight`` times the
    context gap for align. ``press`` (a ``PressConfig``): the windows marked for it read their
    context's KV pressed (``ktm.decode.press.pressed_targets``)."""
    nll = torch.zeros(len(batch), dtype=torch.float32, device=model.device)  # losses are fp32
    n_tok = torch.zeros(len(batch), dtype=torch.long, device=model.device)
    parts: dict[str, tuple[float, int]] = {}
    tokens_in = tokens_out = 0
    # one student forward per (loss, K, allocator of a mixed window)
    groups: dict[tuple[str, int, str], list[int]] = {}
    for i, e in enumerate(batch):
        obj = e.meta["objective"]
        kind = obj if obj in ("distill", "align", "answer") else "ce"
        key = (kind, e.meta.get("k", model.k), e.meta.get("signal", ""),
               press is not None and e.meta.get("press", False))
        groups.setdefault(key, []).append(i)
    for (kind, k, signal, pressed), idx in sorted(groups.items()):
        sub = [batch[i] for i in idx]
        if kind == "answer":  # then distilled on the teacher's own answer
            sub = teacher_answers(model, sub)
        deep = kind == "distill" and distill_hidden > 0
        # a short window read at a ratio its units cannot split to: that is the window's ratio
        # a mixed window's layout: its segments read at a ratio spend their positions by
        # ``signal`` ("": the model's own allocator), for this reading alone
        layout = Layout(allocator=signal) if signal else None
        with merging_at(model, k), quiet_ratio():
            prefixes = model.encode_prompts([e.segments for e in sub], layout=layout)
            if pressed:
                from ktm.decode.press import pressed_targets

                t = pressed_targets(model, prefixes,
                                    [target_ids(model, e.target) for e in sub], press)
            else:
                t = target_logits(model, [e.segments for e in sub], [e.target for e in sub],
                                  prefixes=prefixes, hidden=deep,
                                  prompt_hidden=kind == "align")
            if kind == "align":
                gap = _context_gap(model, sub, prefixes, t.prompt_hidden)
        if kind in ("distill", "answer"):
            teacher = teacher_logits(model, sub, hidden=deep)
            tok = kl_per_token(t.logits, teacher.logits)
            if deep:
                tok = tok + distill_hidden * _hidden_gap(t.hidden, teacher.hidden)
        else:
            tok = nn.functional.cross_entropy(t.logits, t.labels, reduction="none")
            if kind == "align":
                tok = tok + align_weight * gap[t.rows]
        per = tok.new_zeros(len(sub)).index_add(0, t.rows, tok)
        where = torch.tensor(idx, device=model.device)
        nll = nll.index_add(0, where, per)
        n_tok[where] = torch.tensor(t.lengths, device=model.device)
        tokens_in += t.tokens_in
        tokens_out += t.tokens_out
        for j, e in enumerate(sub):
            name = e.meta["objective"]
            v, n = parts.get(name, (0.0, 0))
            parts[name] = (v + float(per[j].detach()), n + t.lengths[j])
    return LossOutput(nll.sum() / n_tok.sum(), nll, n_tok, tokens_in, tokens_out, parts)


def _readability_eval(model, config: PretrainConfig, world, press) -> Callable[[object], dict]:
    """``train``'s ``evaluate``: readability R on ``config.eval_sets`` at the model's K, at the
    mix's other levels ("code@k2"), at each of ``config.eval_ratios`` ("code@r4") and, with a
    press, read stacked as it learns to be ("code@press")."""
    from ktm.evaluation.readability import heldout_readability, heldout_sets

    # read now, so that a missing data folder fails before training, not after it; by rank 0
    # alone, the one process that evaluates (its failure stops the others too)
    cache: dict = {}
    distributed.on_main(lambda: heldout_sets(model.tokenizer, config.eval_sets,
                                             config.n_eval_windows, cache=cache),
                        world, model.device)

    def evaluate(m) -> dict:
        r = heldout_readability(m, config.eval_sets, config.n_eval_windows, _cache=cache)
        for k in sorted(set(config.k_weights) - {m.k}):  # the mix's other levels
            with merging_at(m, k):
                at = heldout_readability(m, config.eval_sets, config.n_eval_windows,
                                         _cache=cache)
            r.update({f"{name}@k{k}": v for name, v in at.items()})
        for ratio in config.eval_ratios:
            at = heldout_readability(m, config.eval_sets, config.n_eval_windows,
                                     _cache=cache, ratio=ratio)
            r.update({f"{name}@r{ratio:g}": v for name, v in at.items()})
        if press is not None:
            from ktm.decode.press import pressed_as

            with pressed_as(m.runtime, press):
                at = heldout_readability(m, config.eval_sets, config.n_eval_windows,
                                         _cache=cache)
            r.update({f"{name}@press": v for name, v in at.items()})
        return r

    return evaluate


def pretrain(model, config: PretrainConfig, train_config: TrainConfig,
             command: str | None = None, chat: Callable | None = None) -> dict:
    """Train ``model``'s encoder and LoRA to read merged text; returns the last metrics row.

    An ordinary ``train`` run on the windows ``config`` describes, written to
    ``train_config.out_dir`` (raises as ``train`` does); ``command`` is recorded in ``run.json``.
    ``chat``: how a chat reads (messages -> segments) for ``config.chat_share`` > 0, the way
    ``ktm serve`` reads one: ``functools.partial(ktm.chat_prompt, model)`` (``ktm pretrain``
    passes it; it lives in the serving layer, above this one). Raises ``KTMError`` for a model
    that does not merge (K=1 without an encoder) or cannot merge at a K of ``config.k_mix``,
    or for a chat share without ``chat``."""
    if not (isinstance(config, PretrainConfig) and isinstance(train_config, TrainConfig)):
        raise KTMError(f"pretrain takes (model, PretrainConfig, TrainConfig), got "
                       f"({type(config).__name__}, {type(train_config).__name__})")
    if (config.chat_share > 0 or config.objective_weights.get("answer", 0) > 0) and chat is None:
        raise KTMError(f"chat_share={config.chat_share} and the answer objective read windows "
                       "as chats: expected chat=functools.partial(ktm.chat_prompt, model)")
    if not merges(model):
        raise KTMError("pretraining a reader needs merging: K=1 without an encoder has nothing "
                       "to learn to read")
    for k in config.k_weights:
        encoder_at(model, k)  # a clear error before any text is read
    if config.eval_sets:  # so is a model too short for R, which runs before the last save
        from ktm.evaluation.readability import check_read_positions

        check_read_positions(model)
    check_window_positions(model, config)
    docs = load_docs(model.tokenizer, config)
    if model.scorer.table is None and (model.config.allocator == "surprisal" or (
            config.mixed_share > 0 and config.signal_weights.get("surprisal", 0) > 0)):
        # the reader's own n-gram table, from the text it trains on; saved with it
        from ktm.core.surprisal import SurprisalTable

        model.scorer.table = SurprisalTable.count(
            (d for ds in docs.values() for d in ds), len(model.tokenizer))
    # the stream covers every process's shard of every step (ktm.training.distributed)
    world = distributed.setup(model.device)
    per_step = train_config.batch_size * train_config.grad_accum * world.size
    stream = WindowStream(docs, config, train_config.max_steps * per_step, train_config.seed,
                          model.eos_id, model.lead_ids, per_step=per_step, top_k=model.k,
                          plain=model.config.plain_prefix + model.config.plain_suffix,
                          chat=None if chat is None else (model.tokenizer.decode, chat))
    # n_examples in run.json is then the windows this run will see
    press = None
    if config.press is not None:
        from ktm.decode.press import PressConfig, import_kvpress

        import_kvpress()  # a missing kvpress fails before training
        press = PressConfig(config.press, config.press_ratio)
    evaluate = _readability_eval(model, config, world, press) if config.eval_sets else None

    def loss_fn(m, batch):
        return pretrain_loss(m, batch, config.distill_hidden, config.align_weight, press)

    return train(model, stream, train_config, evaluate=evaluate, loss_fn=loss_fn,
                 run_extra={"pretrain": config.to_dict(), "command": command,
                            "docs": {k: len(v) for k, v in docs.items()}})
