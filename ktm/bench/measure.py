"""Timing one benchmark run: exact-length synthetic prompts, prefill/decode and training steps.

``infer_once`` runs ``ktm.decode.generate``'s own prefill and decode loop with a clock between the
stages; ``train_once`` is one step of ``ktm.training.train``. Both record peak memory.
``interleave`` orders the runs of several methods.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from ktm.core.prompt import Segment
from ktm.decode.generate import GenerationConfig, decode_steps
from ktm.errors import KTMError
from ktm.tasks.base import Example
from ktm.training.ahead import tokenized
from ktm.training.compiled import compiled_body
from ktm.training.compiled import resolve as resolve_compile
from ktm.training.train import train_step
from ktm.util.timing import clock


# ---------------------------------------------------------------- synthetic prompts
def word_pool(tokenizer, seed: int = 0, size: int = 1024) -> list[str]:
    """Words that are one token each and stay one token inside text: ' word' (space + letters).

    A word start is read from the token's own piece where it is a SentencePiece one (``▁word``:
    decoding it alone drops that space), else from its decoded text (byte-level BPE's ``Ġword``).
    """
    order = torch.randperm(len(tokenizer), generator=torch.Generator().manual_seed(seed),
                           device="cpu").tolist()  # host-side, whatever torch's default device
    special, pool = set(tokenizer.all_special_ids), []
    for i in order:
        piece = tokenizer.convert_ids_to_tokens(i) or ""
        s = " " + piece[1:] if piece.startswith("\u2581") else tokenizer.decode([i])
        if (i in special or len(s) < 2 or s[0] != " " or not s[1:].isascii()
                or not s[1:].isalpha()):
            continue
        if tokenizer(s, add_special_tokens=False)["input_ids"] == [i]:
            pool.append(s)
            if len(pool) == size:
                break
    if len(pool) < 4:
        raise KTMError(f"found only {len(pool)} single-token words in the tokenizer; "
                       "expected a tokenizer with ' word' tokens (byte-level BPE 'Ġword' or "
                       "SentencePiece '▁word')")
    return pool


def synthetic_text(model, n_tokens: int, seed: int, pool: list[str], first: bool = True) -> str:
    """Deterministic text that tokenizes to exactly ``n_tokens`` (special tokens included):
    one pool word per token. A tokenizer whose merges span word boundaries reads words together
    as more or fewer tokens; its text is then longer, cut at ``n_tokens`` token ids."""
    n_special = len(model.tokenize(pool[0], first=first)) - 1
    n_words = n_tokens - n_special
    if n_words < 1:
        raise KTMError(f"length {n_tokens} leaves no room after {n_special} special tokens")
    text = _words(pool, n_words, seed)
    got = len(model.tokenize(text, first=first))
    if got == n_tokens:
        return text
    return _cut(model, _words(pool, 2 * n_words + 8, seed), n_tokens, first, got)


def _words(pool: list[str], n: int, seed: int) -> str:
    idx = torch.randint(len(pool), (n,), generator=torch.Generator().manual_seed(seed),
                        device="cpu")
    return "".join(pool[i] for i in idx.tolist())


def _cut(model, text: str, n_tokens: int, first: bool, got: int) -> str:
    """``text`` cut to its first ``n_tokens`` token ids, decoded; cut again while the decoded
    text reads differently at its end."""
    from ktm.decode.text_stream import decode_continuation

    for _ in range(4):
        ids = model.tokenize(text, first=first)
        if len(ids) == n_tokens:
            return text
        if len(ids) < n_tokens:
            break
        text = decode_continuation(model.tokenizer, ids[:n_tokens])
    raise KTMError(
        f"synthetic prompt has {got} tokens, expected exactly {n_tokens}: this tokenizer's "
        "merges span word boundaries (its single-token words read as other tokens side by "
        "side), and no cut of a longer text read exactly that many; expected a tokenizer that "
        "splits text at spaces before merging (byte-level BPE with its regex, SentencePiece), "
        "or other --lengths")


# ---------------------------------------------------------------- measurement helpers
def interleave(run, methods: list, warmup: int, repeats: int, tick=None
               ) -> dict[str, list[dict]]:
    """Call ``run(method)`` A B C ... per pass, reversed on odd passes, so slow drifts of a shared
    machine hit every method alike; keep the timed passes, by each method's ``key``."""
    runs: dict[str, list[dict]] = {m.key: [] for m in methods}
    for r in range(warmup + repeats):
        for m in methods if r % 2 == 0 else methods[::-1]:
            res = run(m)
            if r >= warmup:
                runs[m.key].append(res)
            if tick:
                tick()
    return runs


def encode_prefix(model, rows: list[list[int]], merge: bool, ratio: float | None = None) -> list:
    """Token ids per sample -> their ``CompressedPrompt``s, through ``encode_prompts``;
    ``ratio``: read at that ratio (adaptive merging, the allocator's time included)."""
    prompts = [(Segment("", ids=tuple(r), ratio=ratio if merge else None),) for r in rows]
    return model.encode_prompts(prompts, merge)


class PeakMemory:
    """Peak memory inside a ``with`` block: CUDA max allocated, or process RSS sampled on CPU.

    ``interval_s`` None: no sampling thread (its wake-ups every 2 ms cost a CPU decode a few
    percent, fine when every method pays them, not when one is timed against code without it);
    the CPU peak is then the larger RSS of the block's start and end."""

    def __init__(self, device: torch.device, interval_s: float | None = 0.002):
        self.cuda = device.type == "cuda"
        self.device = device  # the model's GPU, which need not be the current one
        self.kind = "cuda_max_allocated" if self.cuda else "rss"
        self.interval_s, self.start, self.peak = interval_s, 0, 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096
        except OSError:  # not Linux: the lifetime high-water mark is the best we get
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            self.start = self.peak = self.rss()
            if self.interval_s is not None:
                self._thread = threading.Thread(target=self._sample, daemon=True)
                self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            if self.interval_s is not None:
                self._stop.set()
                self._thread.join()
            self.peak = max(self.peak, self.rss())


def trim_allocator() -> None:
    """Return freed heap pages to the OS (glibc), so the next RSS peak is the next run's own."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS then also counts memory kept for reuse
        pass


@torch.inference_mode()
def infer_once(model, rows: list[list[int]], merge: bool, output_tokens: int,
               sample_memory: bool = True, ratio: float | None = None, runtime=None) -> dict:
    """Time one batch through ``ktm.decode.generate``'s own prefill and decode loop (greedy,
    no early stop): encoder, prefill, first token, then the KV-cached decode, on ``runtime``
    (None: the model's own). ``sample_memory`` False: no RSS sampling thread beside the timed
    code (``PeakMemory``)."""
    dev = model.device
    cfg = GenerationConfig(max_new_tokens=output_tokens, stop_at_eos=False)
    runtime = runtime or model.runtime
    runtime.clear()  # a timed run prefills everything: no rows cached from the last one
    with PeakMemory(dev, 0.002 if sample_memory else None) as mem:
        t0 = clock(dev)
        prefixes = encode_prefix(model, rows, merge, ratio)
        t1 = clock(dev)
        state = runtime.prefill(prefixes, [cfg] * len(prefixes))  # as decode_steps' own
        t2 = clock(dev)
        steps = decode_steps(model, None, cfg, state=state, runtime=runtime)
        tokens = [next(steps)]
        t3 = clock(dev)
        kv = runtime.kv_bytes(state)
        tokens += list(steps)
        t4 = clock(dev)
    b, decoded = len(rows), output_tokens - 1
    return {
        "encoder_s": t1 - t0, "prefill_s": t2 - t0, "ttft_s": t3 - t0, "decode_s": t4 - t3,
        "e2e_s": t4 - t0, "samples_per_s": b / (t4 - t0),
        "decode_tokens_per_s": b * decoded / (t4 - t3) if decoded else None,
        "compressed_tokens": max(cp.tokens_out for cp in prefixes), "kv_cache_bytes": kv,
        "peak_mem_bytes": mem.peak, "peak_mem_delta_bytes": mem.peak - mem.start,
        "tokens": torch.stack(tokens, 1).tolist(),
    }


def train_once(model, opt, prompts: list[str], targets: list[str], merge: bool,
               ratio: float | None = None, compile: str = "auto") -> dict:
    """Time one training step through ``ktm.training.train.train_step`` (forward, backward,
    clip, AdamW), with the same definition of input tokens/s as ``ktm train``; ``compile``:
    through the compiled LM body where it resolves on (``ktm.training.compiled``). The window
    is tokenized before the clock starts, as ``ktm train``'s loop tokenizes each window while
    the step before it runs (``ktm.training.ahead``)."""
    window = [tokenized(model, Example((Segment(p, compress=merge,
                                                ratio=ratio if merge else None),), t))
              for p, t in zip(prompts, targets)]
    dev = model.device
    model.train()
    with PeakMemory(dev) as mem:
        t0 = clock(dev)
        with compiled_body(model, resolve_compile(compile, dev)):
            st = train_step(model, opt, window, len(window), clip_norm=1.0)
        t1 = clock(dev)
    model.eval()
    return {"step_s": t1 - t0, "input_tokens_per_s": st.input_tokens / (t1 - t0),
            "compressed_tokens": st.lm_prompt_tokens // len(prompts),
            "loss": st.loss_sum / st.target_tokens,
            "peak_mem_bytes": mem.peak, "peak_mem_delta_bytes": mem.peak - mem.start}
