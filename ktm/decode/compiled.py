"""The compiled runtime: a static KV cache and one ``torch.compile``d LM step per shape, and a
prefill compiled over every length.

Eager decoding calls the LM's Python modules once per token; on a GPU each step is then bound
by kernel launches (a 7B model: 28 ms a step with the GPU busy for 7). Here a batch's prefilled
KV (``DynamicCache``, from the eager prefill, prefix reuse and presses included) is copied once
into transformers' ``StaticCache`` of a fixed length, and every later step runs one compiled
function of fixed shapes: CUDA graphs on CUDA (``mode="reduce-overhead"``), inductor's C++ on
the CPU. transformers' static cache is what its own compiled ``generate`` uses; what is ours is
only the hand-over from ktm's prefill (merged embeddings at their own positions, left-padded
batches, pressed caches) to it.

Shapes are fixed per (batch, cache length): the cache length is rounded up to a bucket of at
least ``MIN_BUCKET`` positions, four to an octave (1,024, 1,280, 1,536, 1,792, 2,048, ...), so
prompts of many lengths share one compiled step and a step attends over at most a quarter more
positions than it fills; the (B, length) attention mask is built once per batch (the prompt's
padding off, every later slot on: causality hides the slots not yet written). Compiles are counted
(``CompiledStep.compiles``) and each new shape says so in one progress line. A server makes many
shapes (rows × buckets), more than torch's default limit of 8 graphs per function, past which
torch would run a new shape eagerly without a word: our compiled calls raise that limit to
``SHAPES`` (``room_for_shapes``).

One static cache is kept per shape and reused, zeroed, by the next batch of that shape: CUDA graphs
replay only over the buffers they were recorded with, so a fresh cache per request would record
the graph again each time. A batch whose cache a later batch of its shape took over is refused by
name rather than decoded over another's KV.

The server's batch, which rows join and leave between steps, goes back to a dynamic cache for
each change (``back``: its filled positions copied out), is joined or cut there, and at its next
step comes back onto a static cache with its rows padded to a power of two (copies of its first
row, whose outputs are dropped), so its shapes stay few and a new request compiles nothing new.
New rows waiting to join stay dynamic: they never take over the running batch's cache.

The prefill (``CompiledStep.prefill``) is the same forward compiled once with dynamic shapes
(``torch.compile(dynamic=True)``: one graph for every prompt length and batch above one, one more
for a batch of one) into the eager ``DynamicCache`` that decoding then reads, static or not. It
has no CUDA graph: prompt lengths vary. Length buckets would pad a prompt by up to a quarter of
its positions; a dynamic graph reads exactly its own. Where it pays (``resolve_prefill``),
measured on one H200 at Qwen2.5-Coder-7B's shape, bf16, batch 1 (``results/bench/README.md``):
a prefill of 256 positions takes 20.5 ms against eager's 40.5, of 1,024 31.9 against 36.6 (K=4
over 4k tokens) or 30.1 against 38.2 (plain 1k), of 4,096 115.2 against 116.9, and of 16,384
729.7 against 510.3. So ``auto`` compiles a prefill of up to 1,024 positions (batch x longest
prompt) on CUDA, never on the CPU.

Where it pays (``resolve``), measured (``results/bench/README.md``):
- On the CPU, never: the K=4 reader (SmolLM2-135M), fp32, one thread, 2,048 tokens in, 64 out:
  15.8 tokens/s against eager's 14.3 plain, 18.6 against 16.6 at K=4
  (``results/bench/compiled_cpu_int8.json``); a CPU step is bound by reading the weights and the
  cache, not by launches, and a tenth does not earn back a compile in most answers. With int8
  weights (``ktm.core.int8``, ``--weights int8``) the compiled step reads them through fused
  dot products: 33.8 tokens/s plain (2.36x eager fp32) and 49.5 at K=4 (2.98x).
- On CUDA, for a batch of up to 64k cache positions (batch × bucket). Qwen2.5-Coder-7B's shape,
  bf16, one H200: at batch 1 and 4k positions a step takes 6.5 ms against eager's 32.6 (5.0x),
  3.8x at 1k; at batch 16, 1.8x over 1,280 positions, 1.4x over 2,560, and 0.78x over 5,120
  (the GPU is then busy, and a bucket reads up to a quarter more positions than it fills).
  Each new shape compiles once per process, 30 to 40 s at that size: an answer of a few hundred
  tokens run once is faster with ``off``.
``on`` compiles on every device.
"""

from __future__ import annotations

import functools
import sys
import weakref
from contextlib import contextmanager

import torch
from transformers import DynamicCache, StaticCache

from ktm.decode.generate import windowed_layers
from ktm.errors import KTMError

COMPILE_MODES = ("auto", "off", "on")
MIN_BUCKET = 256
# where ``auto`` compiles (the module docstring): per device type, the most cache positions
# (batch × bucket) a compiled step was measured to pay for; a device type not listed: none
PAYS = {"cpu": 0, "cuda": 65536}
# where ``auto`` compiles the prefill: per device type, the most positions (batch x longest
# prompt) a compiled prefill was measured to pay for (the module docstring)
PREFILL_PAYS = {"cpu": 0, "cuda": 1024}
# graphs the compiled step and prefill may make in a process (torch's recompile limit while they
# run; its default is 8): a server pads its rows to 7 powers of two up to 64, times 4 buckets an
# octave from 256 to 128k positions (37), in one dtype
SHAPES = 512


def check_mode(mode: str) -> str:
    if mode not in COMPILE_MODES:
        raise KTMError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
    return mode


def resolve(mode: str, device: torch.device, positions: int | None = None,
            limits: dict[str, int] = PAYS) -> bool:
    """Whether a batch of ``positions`` cache positions (``positions``: batch × bucket; None:
    not known) decodes compiled on ``device`` under ``mode`` (auto: where ``limits``, per
    device type the most positions measured to pay, says; ``PAYS`` for the decode step)."""
    check_mode(mode)
    if mode != "auto":
        return mode == "on"
    limit = limits.get(torch.device(device).type, 0)
    return positions is not None and 0 < positions <= limit


def resolve_prefill(mode: str, device: torch.device, positions: int) -> bool:
    """Whether a prefill of ``positions`` (batch x longest prompt) runs compiled
    (``CompiledStep.prefill``) on ``device`` under ``mode`` (auto: where ``PREFILL_PAYS``
    says)."""
    return resolve(mode, device, positions, PREFILL_PAYS)


def positions(batch: int, filled: int, new_tokens: int) -> int:
    """The cache positions a batch of ``batch`` rows, ``filled`` positions each, with room for
    ``new_tokens`` more, holds on the compiled step (what ``PAYS`` bounds)."""
    return batch * bucket(filled + new_tokens)


def padded_rows(rows: int) -> int:
    """The rows a rebatched batch of ``rows`` is padded to: the power of two that holds it."""
    return 1 << (rows - 1).bit_length()


def bucket(n: int) -> int:
    """The static cache length for ``n`` positions: at least ``MIN_BUCKET``, else the least
    multiple of a quarter of the power of two below ``n`` that holds it."""
    if n <= MIN_BUCKET:
        return MIN_BUCKET
    quarter = (1 << (n - 1).bit_length() - 1) // 4
    return -(-n // quarter) * quarter


def refusal(state) -> str | None:
    """Why ``state`` (a prefilled ``DecodeState``) cannot decode compiled, None if it can: a
    static cache holds full-attention layers only, and a head-wise press's hidden keys are
    applied by patching attention, which a compiled step does not see."""
    if state.cache is None:
        return "the batch decodes without a KV cache (use_cache=False)"
    kinds = windowed_layers(state.cache)
    if kinds:
        return f"its cache has layers other than full attention ({', '.join(kinds)})"
    if state.hidden is not None:
        return "a head-wise KV press hides keys per head"
    return None


class CompiledStep:
    """One model's compiled decode step; ``start`` moves a prefilled batch onto a static cache,
    ``step`` reads one token per row. ``compiles``: graphs compiled so far."""

    def __init__(self, lm_config, device: torch.device):
        self.lm_config = lm_config
        cuda = torch.device(device).type == "cuda"
        self._fn = torch.compile(_forward, dynamic=False, fullgraph=False,
                                 mode="reduce-overhead" if cuda else None)
        self._prefill_fn = None  # made on first use (``prefill``)
        self.shapes: set[tuple] = set()
        self.compiles = 0
        # (batch, length, dtype, device) -> [StaticCache, weak reference to the state using it]
        self._caches: dict[tuple, list] = {}

    def start(self, state, new_tokens: int, pad_rows: bool = False) -> None:
        """Copy ``state``'s KV into a static cache with room for ``new_tokens`` more positions
        (rounded up to a bucket) and build the batch's fixed mask; ``state.cache`` becomes it.
        ``pad_rows``: pad the rows to a power of two (``padded_rows``) with copies of the first
        (a batch that rows join and leave)."""
        why = refusal(state)
        if why is not None:
            raise KTMError(f"the compiled decode step cannot run this batch: {why}; use "
                           "compile='off' (--compile off)")
        layers = state.cache.layers
        first = layers[0].keys
        rows, filled = first.shape[0], first.shape[-2]
        total = padded_rows(rows) if pad_rows else rows
        length = bucket(filled + new_tokens)
        key = (total, length, first.dtype, str(first.device))
        if key in self._caches:
            static = self._caches[key][0]
            static.reset()
        else:
            static = StaticCache(config=self.lm_config, max_cache_len=length)
            if len(static.layers) != len(layers):
                raise KTMError(f"a static cache of {len(static.layers)} layers for a prefill of "
                               f"{len(layers)}: expected one each")
        self._caches[key] = [static, weakref.ref(state)]
        for i, layer in enumerate(layers):
            static.layers[i].update(_pad(layer.keys, total), _pad(layer.values, total))
        if state.mask.shape[1] != filled:
            raise KTMError(f"a mask over {state.mask.shape[1]} positions for a cache of "
                           f"{filled}: expected one column each")
        mask = state.mask.new_ones(total, length)
        mask[:, :filled] = _pad(state.mask, total)
        state.cache, state.static_mask = static, mask

    def prefill(self, lm, embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                cache) -> torch.Tensor:
        """The compiled prefill: (B, L, D) embeddings, (B, L) mask and positions read into
        ``cache`` (an empty ``DynamicCache``) -> (B, V) next-token logits."""
        if self._prefill_fn is None:
            print("ktm: compiling the prefill (once per process, for every prompt length)",
                  file=sys.stderr, flush=True)
            self._prefill_fn = torch.compile(_prefill_forward, dynamic=True)
        before = graphs()
        with room_for_shapes():
            logits = self._prefill_fn(lm, embeds, mask, positions, cache)
        self.compiles += graphs() - before
        return logits

    def back(self, state) -> None:
        """Move a batch on the static cache back to a dynamic one (its real rows' filled
        positions, copied; the static cache stays for the next batch of its shape), to be
        joined or cut; eager until ``start`` again."""
        rows = state.logits.shape[0]
        filled = int(state.cache.layers[0].cumulative_length)
        cache = DynamicCache(config=self.lm_config)
        for i, layer in enumerate(state.cache.layers):
            cache.update(layer.keys[:rows, :, :filled].clone(),
                         layer.values[:rows, :, :filled].clone(), i)
        state.mask = state.static_mask[:rows, :filled].clone()
        state.cache, state.static_mask = cache, None

    def step(self, lm, state, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, 1, D) embeddings at (B, 1) positions -> (B, V) next-token logits; the static
        cache grows by one position."""
        rows, total = embeds.shape[0], state.static_mask.shape[0]
        held = self._caches.get((total, state.static_mask.shape[1],
                                 state.cache.layers[0].keys.dtype, str(embeds.device)))
        if held is None or held[0] is not state.cache or held[1]() is not state:
            raise KTMError("this batch's static cache was taken over by a later batch of the "
                           "same shape (one cache per shape is kept): finish a compiled batch "
                           "before starting the next of its shape, or use compile='off'")
        embeds, positions = _pad(embeds, total), _pad(positions, total)
        shape = (*embeds.shape, state.static_mask.shape[1], embeds.dtype, str(embeds.device))
        if shape not in self.shapes:
            print(f"ktm: compiling the decode step for a batch of {total} and "
                  f"{state.static_mask.shape[1]} cache positions (once per shape)",
                  file=sys.stderr, flush=True)
        before = graphs()
        with packed_attention(lm, embeds.device), room_for_shapes():
            logits = self._fn(lm, embeds, state.static_mask, positions, state.cache)
        self.compiles += graphs() - before
        self.shapes.add(shape)
        # CUDA graphs hand out the same output buffer at every replay: keep a copy
        return logits[:rows].clone()


def packed_gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                         scaling: float | None = None, is_causal: bool | None = None,
                         **kwargs):
    """transformers' SDPA attention, with one query position over grouped KV heads read as the
    group's queries of its one KV head: (B, H, 1, D) -> (B, H_kv, H / H_kv, D), the (B, 1, 1, L)
    mask shared by them. What transformers' own eager path does for that case; under
    ``torch.compile`` it copies each KV head out to its group instead (``repeat_kv``), every
    step, which on a CPU made the compiled step slower than eager (7.4 tokens/s against 9.4 at
    2,048 tokens, ``results/bench/compiled_cpu.json``). Any other case is transformers' own
    function, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain = all(kwargs.get(k) is None for k in ("position_bias", "softcap", "s_aux",
                                                 "sliding_window"))
    if (groups > 1 and query.shape[2] == 1 and not dropout and plain
            and (attention_mask is None or attention_mask.shape[1] == 1)):
        b, h, _, d = query.shape
        mask = attention_mask if attention_mask is None else attention_mask[..., :key.shape[-2]]
        out = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(b, h // groups, groups, d), key, value, attn_mask=mask, scale=scaling)
        return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


PACKED = "ktm_packed_gqa"  # its name in transformers' attention registry
# where the compiled step reads through it (measured to pay): per device type; on CUDA it is
# not measured yet, and the step keeps transformers' own path there
PACKED_DEVICES = ("cpu",)


@functools.cache
def _register_packed() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED, packed_gqa_attention)
    AttentionMaskInterface.register(PACKED, sdpa_mask)  # the masks SDPA reads


@contextmanager
def packed_attention(lm, device: torch.device):
    """Run ``lm``'s SDPA attention as ``packed_gqa_attention`` inside the block, on the devices
    of ``PACKED_DEVICES``; other attention implementations and devices are left as they are,
    and so are models whose attention does not call transformers' attention registry (Falcon,
    StableLM, Jamba: they test the implementation's name, and under another name take their
    eager path, which reads a float mask, not SDPA's boolean one)."""
    config = getattr(lm, "config", None)
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # PEFT's wrapper
    if (torch.device(device).type not in PACKED_DEVICES
            or getattr(config, "_attn_implementation", None) != "sdpa"
            or not getattr(type(base), "_supports_attention_backend", False)):
        yield
        return
    _register_packed()
    config._attn_implementation = PACKED
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def room_for_shapes():
    """torch's recompile limits raised to ``SHAPES`` graphs while a compiled call runs (a
    function's own, and the process's across functions where that is lower): past its default
    of 8 graphs per function torch runs a new shape eagerly, without a word (the module
    docstring); other compiled code in the process keeps its own settings."""
    import torch._dynamo.config as dynamo

    return dynamo.patch(recompile_limit=max(dynamo.recompile_limit, SHAPES),
                        accumulated_recompile_limit=max(dynamo.accumulated_recompile_limit,
                                                        SHAPES))


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with rows (dim 0) added up to ``rows``, each a copy of its first."""
    extra = rows - t.shape[0]
    return t if extra == 0 else torch.cat([t, t[:1].expand(extra, *t.shape[1:])])


def _forward(lm, embeds, mask, positions, cache):
    return lm(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
              past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]


def _prefill_forward(lm, embeds, mask, positions, cache):
    # its own function, not ``_forward``: dynamo keeps compiled code per function, and this one
    # compiles with dynamic shapes and no CUDA graph
    return lm(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
              past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]


def graphs() -> int:
    """Graphs torch.compile has made in this process (dynamo's own count; a recompile adds
    one)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
