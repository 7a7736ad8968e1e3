"""Readability R: the share of what a context tells the LM that survives merging.

For held-out windows (context, continuation), with NLL per continuation token pooled over all
windows, all three read by the same model (LoRA on):

    merged   the context merged by the encoder, then the continuation
    plain    the context as plain tokens (merge off)
    none     no context: a single plain BOS token (EOS where the tokenizer has no BOS)

Where the tokenizer puts a BOS before every text (``KTMModel.lead_ids``), the merged and
plain contexts start with it too, as a task prompt's first segment does, and "none" is it.

    R = (NLL_none - NLL_merged) / (NLL_none - NLL_plain)

R = 1: merging loses nothing; R = 0: the merged context is worth no context at all; R < 0: it
misleads the LM. R is None when the plain context barely helps: its gain NLL_none - NLL_plain
under ``MIN_GAIN`` (1 %) of NLL_none. A share of a gain that small is a ratio of noise (with a
gain of 1e-6 nats, a merged reading 0.1 nat better than none gives R = 1e5); the gains on the
held-out sets lie far above it (docs/readers.md#readability-r).

That is *continuation* R, and it rewards keeping the last tokens plain: a continuation reads
the recent text most closely. *Recall* R is recency-neutral. Its question is ``RECALL_CUE``
(``ktm.tasks.corpus.recall_question``)
tokens copied from a random place in the context, given plain after it, and its target the
``RECALL_TARGET`` tokens that followed them there (a context shorter than both keeps a third
for the question); the same three readings, the same ratio.
Both are reported (``R`` and ``R_recall``).

A context may be read at a ratio (``ratio``: ``Segment(ratio=...)``, the model's allocator
spending the positions) instead of at the model's K; ``ratio_read`` reports the ratio the
merged contexts were read at (tokens in per position, over all windows).

``R_ci95`` is a percentile bootstrap over windows (1,000 resamples, fixed seed): the range R
would likely take on another draw of as many held-out windows. With 32 or 64 windows it is
several hundredths wide, which is what a difference between two readers must beat. A resample
whose gain is under ``MIN_GAIN`` has no R, and is as good as unbounded: when more than the
interval's own tail (2.5 % of resamples) have none, the interval is None; otherwise it is taken
over the resamples that have one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from ktm.core.allocate import quiet_ratio
from ktm.core.prompt import Segment
from ktm.decode.press import kv_kept, pressed_as
from ktm.errors import KTMError
from ktm.tasks.corpus import Window, WindowSpec, heldout_windows, recall_question

# held-out windows: reviews are short, so a window needs 64 tokens (48 context + 16 target)
READ_SPEC = WindowSpec(context_tokens=256, target_tokens=64, min_tokens=64)


def check_read_positions(model, spec: WindowSpec = READ_SPEC) -> None:
    """Refuse a model whose positions cannot hold a held-out window read plain (the BOS if any,
    ``spec``'s context and continuation): R reads every context both merged and plain."""
    need = len(model.lead_ids) + spec.context_tokens + spec.target_tokens
    if model.max_positions and need > model.max_positions:
        raise KTMError(f"the readability R reads held-out contexts plain: {need} positions "
                       f"(a {spec.context_tokens}-token context and a "
                       f"{spec.target_tokens}-token continuation), over this model's limit "
                       f"of {model.max_positions}: expected no R for this model (ktm pretrain "
                       "--eval-sets none; ktm eval without --readability)")


def none_token(tokenizer) -> int:
    tok = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if tok is None:
        raise KTMError("the tokenizer has neither a BOS nor an EOS token to stand for 'no context'")
    return tok


MIN_GAIN = 0.01  # R needs NLL_none - NLL_plain >= MIN_GAIN * NLL_none (module docstring)


def has_r(gain, nll_none):
    """Whether R is defined for a context gain NLL_none - NLL_plain (floats, or tensors of
    bootstrap resamples): positive and at least ``MIN_GAIN`` of NLL_none."""
    return (gain > 0) & (gain >= MIN_GAIN * nll_none)


def context_ratio(nll_none: float, nll_merged: float, nll_plain: float) -> float | None:
    gain = nll_none - nll_plain
    if not has_r(gain, nll_none):
        return None
    return (nll_none - nll_merged) / gain


BOOTSTRAP = {"resamples": 1000, "seed": 0, "level": 0.95}  # R_ci95's settings, recorded in rows


def r_interval(per_window: torch.Tensor, n_boot: int = BOOTSTRAP["resamples"],
               seed: int = BOOTSTRAP["seed"],
               level: float = BOOTSTRAP["level"]) -> list[float] | None:
    """Percentile bootstrap interval of pooled R; ``per_window`` is (n, 4): summed NLL merged,
    plain, none, and target tokens of each window. None for a single window, or when more than
    the interval's tail of resamples have no R (gain under ``MIN_GAIN``: module docstring)."""
    n = per_window.shape[0]
    if n < 2:
        return None
    # on the CPU, whatever torch's default device: the same resamples on every machine
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (n_boot, n), generator=gen, device="cpu")
    pooled = per_window.cpu().double()[idx].sum(dim=1)  # (n_boot, 4)
    merged, plain, none = (pooled[:, i] / pooled[:, 3] for i in range(3))
    gain = none - plain
    ok = has_r(gain, none)
    tail = (1 - level) / 2
    if n_boot - int(ok.sum()) > tail * n_boot:
        return None
    r = (none - merged)[ok] / gain[ok]
    lo, hi = torch.quantile(r, torch.tensor([tail, 1 - tail], dtype=r.dtype,
                                            device=r.device)).tolist()
    return [lo, hi]


def _pooled(rows: list[torch.Tensor]) -> dict:
    """R, its interval and the three NLLs from (n, 4) rows: summed NLL merged, plain, none, and
    target tokens of each window."""
    per_window = torch.cat(rows)
    total = per_window.sum(dim=0).tolist()
    n_tok = int(total[3])
    nll = {k: total[i] / n_tok for i, k in enumerate(("merged", "plain", "none"))}
    return {"R": context_ratio(nll["none"], nll["merged"], nll["plain"]),
            "R_ci95": r_interval(per_window),
            "nll_merged": nll["merged"], "nll_plain": nll["plain"], "nll_none": nll["none"],
            "target_tokens": n_tok}


def _plain_nll(model, prompts: list, tgt: list, cache: dict | None) -> torch.Tensor:
    """(B,) NLL of each target read after its prompt unmerged and unpressed; with ``cache``
    (the same model reading the same windows under several layouts) each one is computed
    once."""
    with pressed_as(model.runtime, None):  # the reference is never pressed
        if cache is None:
            return model(prompts, tgt, merge=False).nll
        keys = [(tuple(i for s in p for i in s.ids), tuple(t)) for p, t in zip(prompts, tgt)]
        todo = [j for j, key in enumerate(keys) if key not in cache]
        if todo:
            nll = model([prompts[j] for j in todo], [tgt[j] for j in todo], merge=False).nll
            cache.update({keys[j]: v for j, v in zip(todo, nll)})
    return torch.stack([cache[key] for key in keys])


def _three(model, ctx: list, none: list, tgt: list, cache: dict | None = None,
           merge: bool = True, reference=None) -> tuple[torch.Tensor, int, int]:
    """(B, 4) doubles: the NLL of ``tgt`` merged (with ``merge`` off: read plain, as a press
    alone reads it), plain and with no context (by ``reference``, None: ``model``), and its
    tokens; with the merged prompts' tokens in and out."""
    merged = model(ctx, tgt, merge=merge)
    kept = kv_kept(model, model.encode_prompts(ctx, merge, embed=False))
    ref = model if reference is None else reference
    plain = _plain_nll(ref, ctx, tgt, cache)
    empty = _plain_nll(ref, none, tgt, cache)
    cols = (merged.nll, plain, empty, merged.n_tokens)  # doubles: a bf16 count rounds
    # to the CPU first: MPS has no float64
    return (torch.stack([c.cpu().double() for c in cols], dim=1), merged.tokens_in,
            merged.tokens_out, kept)


@torch.no_grad()
def readability(model, windows: Sequence[Window], batch_size: int = 8,
                progress: bool = False, ratio: float | None = None, recall: bool = True,
                seed: int = 0, plain_cache: dict | None = None, merge: bool = True,
                reference=None) -> dict:
    """Continuation R (``R``) and recall R (``R_recall``) with their NLLs, and the exact prompt
    tokens before and after merging. ``ratio``: the contexts read at that ratio (None: at the
    model's K); ``recall`` False: continuation R alone (half the forwards). ``plain_cache``: a
    dict kept across calls on the same model and windows, which then read each plain and
    context-free NLL once (they do not depend on the layout).

    The reading under test is ``model``'s, with its KV press if it has one (``merge`` off: the
    context read plain, as a press alone reads it); the plain and context-free references are
    ``reference``'s (None: ``model``'s), never pressed: a base model as ``reference`` puts
    every reader and press on one scale. ``kv_kept``: the share of the prompt positions whose
    KV the reading keeps (1 - the press's share of the pressed ones; merging's shortening is in
    ``ratio_read``)."""
    if not windows:
        raise KTMError("readability needs at least one window")
    was_training = model.training
    model.eval()
    rows, recall_rows = [], []  # per window: summed NLL merged, plain, none; target tokens
    # a short window read at a ratio its units cannot split to: ratio_read reports it
    with quiet_ratio():
        try:
            _readings(model, windows, batch_size, progress, ratio, recall, seed, rows,
                      recall_rows, plain_cache, merge, reference)
        finally:
            model.train(was_training)
    tokens_in = sum(r[1] for r in rows)
    tokens_out = sum(r[2] for r in rows)
    kept = sum(r[3] for r in rows)
    rows = [r[0] for r in rows]
    out = {**_pooled(rows), "windows": len(windows),
           "tokens_in": tokens_in / len(windows), "tokens_out": tokens_out / len(windows),
           "ratio": ratio, "ratio_read": tokens_in / tokens_out, "kv_kept": kept / tokens_in}
    if recall:
        out.update({k.replace("R", "R_recall", 1) if k.startswith("R") else f"recall_{k}": v
                    for k, v in _pooled(recall_rows).items()})
    return out


def _readings(model, windows: Sequence[Window], batch_size: int, progress: bool,
              ratio: float | None, recall: bool, seed: int, rows: list, recall_rows: list,
              cache: dict | None = None, merge: bool = True, reference=None) -> None:
    """``readability``'s forwards: per batch, (NLL rows, tokens in, tokens out) into ``rows``
    and the recall rows into ``recall_rows``."""
    lead = model.lead_ids  # a BOS the tokenizer would put first, as prompts get it
    start = lead or (none_token(model.tokenizer),)
    for i in tqdm(range(0, len(windows), batch_size), desc="readability",
                  disable=not progress):
        batch = windows[i:i + batch_size]
        ctx = [Segment("", ids=lead + w.context, ratio=ratio) for w in batch]
        rows.append(_three(model, [(c,) for c in ctx],
                           [(Segment("", compress=False, ids=start),)] * len(batch),
                           [w.target for w in batch], cache, merge, reference))
        if recall:
            qa = [recall_question(w, seed) for w in batch]
            part, *_ = _three(
                model, [(c, Segment("", compress=False, ids=q)) for c, (q, _) in
                        zip(ctx, qa)],
                [(Segment("", compress=False, ids=start + q),) for q, _ in qa],
                [t for _, t in qa], cache, merge, reference)
            recall_rows.append(part)


def heldout_sets(tokenizer, sets: Sequence[str], n: int, seed: int = 0,
                 cache: dict | None = None, spec: WindowSpec = READ_SPEC
                 ) -> dict[str, list[Window]]:
    """The ``n`` held-out windows of each set (a held-out set's name, or a file or folder of
    the user's own text), read once per (set, n, seed, spec) into ``cache``."""
    cache = {} if cache is None else cache
    for name in sets:
        if (name, n, seed, spec) not in cache:
            cache[(name, n, seed, spec)] = heldout_windows(tokenizer, name, n, spec, seed)
    return {name: cache[(name, n, seed, spec)] for name in sets}


def read_spec(context_tokens: int | None) -> WindowSpec:
    """The windows R reads: ``READ_SPEC``, or its continuation after a context of
    ``context_tokens`` (a document needs both)."""
    if context_tokens is None or context_tokens == READ_SPEC.context_tokens:
        return READ_SPEC
    t = READ_SPEC.target_tokens
    return WindowSpec(context_tokens=context_tokens, target_tokens=t,
                      min_tokens=context_tokens + t)


def heldout_readability(model, sets: Sequence[str] = ("reviews", "code"), n: int = 64,
                        seed: int = 0, progress: bool = False,
                        _cache: dict | None = None, ratio: float | None = None,
                        recall: bool = True, plain_cache: dict | None = None,
                        context_tokens: int | None = None, merge: bool = True,
                        reference=None) -> dict:
    """R and recall R per held-out set (``reviews``: other product categories, ``code``: unseen
    repos, ``stdlib``; or a file or folder of the user's own text), the contexts
    (``context_tokens``, default ``READ_SPEC``'s) read at the model's K or at ``ratio``, with
    its press if it has one (``readability``: ``merge``, ``reference``)."""
    spec = read_spec(context_tokens)
    check_read_positions(model, spec)
    windows = heldout_sets(model.tokenizer, sets, n, seed, _cache, spec)
    return {name: readability(model, windows[name], progress=progress, ratio=ratio,
                              recall=recall, seed=seed, plain_cache=plain_cache, merge=merge,
                              reference=reference)
            for name in sets}
