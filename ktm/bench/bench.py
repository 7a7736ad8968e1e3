"""Efficiency benchmark: uncompressed vs K-token merging, interleaved in one run.

For every (input length, batch size) the methods run A B C A B C ... (order reversed on odd
repeats) after warm-up, so slow drifts of a shared machine hit every method alike. Speed-ups are
medians of per-repeat ratios against the uncompressed run of the *same* repeat. Peak memory
comes from one extra untimed run per method (see ``memory_pass``).

    infer: ids -> [encoder] -> prefill (KV cache filled) -> first token -> greedy decode
    train: LoRA training step (forward + backward + clip + AdamW) at a fixed input length

Prompts are synthetic text built from single-token words, so a prompt has exactly the requested
number of tokens (checked). Inference starts from token ids: tokenization is outside the timings.

    ktm bench --quick                       # about two minutes on 2 CPU cores
    ktm bench --lengths 2048 --ks 2 4       # the prefill speed-up targets
"""

from __future__ import annotations

import gc
import math
import statistics
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ktm.bench.measure import (
    infer_once,
    interleave,
    synthetic_text,
    train_once,
    trim_allocator,
    word_pool,
)
from ktm.core.base_model import parse_dtype
from ktm.core.config import DEFAULT_MODEL, check_ratio
from ktm.core.encoder import EncoderConfig, KTokenEncoder, RecursiveEncoder
from ktm.core.int8 import check_weights
from ktm.decode.compiled import check_mode as check_compile
from ktm.decode.compiled import graphs
from ktm.decode.press import PressConfig, pressed_as
from ktm.errors import KTMError
from ktm.model import BACKENDS, RuntimeSpec
from ktm.training.train import adamw
from ktm.util.field_types import check_at_least
from ktm.util.fileio import check_writable, write_json_atomic
from ktm.util.provenance import git_revision, versions

MODES = ("infer", "train", "serve", "hf")
QUICK = {"lengths": (256, 1024, 2048), "ks": (2, 4, 8), "repeats": 3, "output_tokens": 8}
# --mode serve replaces options left at their defaults with these (then with SERVE_QUICK)
SERVE = {"lengths": (1024,), "ks": (2, 4), "repeats": 3, "out": "results/bench/serve.json"}
SERVE_QUICK = {"lengths": (256,), "clients": (1, 4), "requests": 8, "output_tokens": 8}
# --mode hf likewise (ktm.bench.versus_hf)
HF = {"lengths": (512,), "output_tokens": 64, "out": "results/bench/decode_vs_hf.json"}


@dataclass
class BenchConfig:
    model: str = field(default=DEFAULT_MODEL, metadata={
        "help": "embedded model name, local HF model folder, or ktm checkpoint folder"})
    shape: str | None = field(default=None, metadata={
        "help": "time an architecture with random weights instead of --model: a known shape "
                "(qwen2.5-coder-7b, qwen2.5-0.5b) or an HF config.json; built on --device in "
                "--dtype, prompts from a synthetic tokenizer (ktm.bench.shapes)"})
    mode: str = field(default="infer", metadata={
        "help": "infer: prefill/decode timings; train: LoRA training-step throughput; "
                "serve: ktm serve under 1/4/16 concurrent clients (see ktm.bench.serve); "
                f"hf: ktm's decode against transformers' generate (ktm.bench.versus_hf, {HF})",
        "choices": MODES})
    lengths: tuple[int, ...] = field(default=(256, 512, 1024, 2048, 4096), metadata={
        "help": "prompt lengths in tokens (exact)"})
    batch_sizes: tuple[int, ...] = field(default=(1,), metadata={"help": "batch sizes"})
    ks: tuple[int, ...] = field(default=(1, 2, 3, 4, 8), metadata={"help": "merge factors K"})
    mlp_ratios: tuple[float, ...] = field(default=(2.0,), metadata={
        "help": "encoder MLP width = ratio * K * hidden (2.0 = paper width); several to compare"})
    inner_k: int = field(default=1, metadata={
        "help": "recursive encoders: each K that this divides (and exceeds) merges blocks of "
                "inner_k first, as the shipped readers do (inner_k 2 at --mlp-ratios 0.5); "
                "1: one level, the paper's"})
    ratios: tuple[float, ...] = field(default=(), metadata={
        "help": "adaptive merging: also read each prompt at these ratios (tokens per position), "
                "with the model's own encoder levels and allocator, its time included"})
    backends: tuple[str, ...] = field(default=("torch",), metadata={
        "help": "runtimes that prefill and decode: torch, llamacpp (the [llamacpp] extra) "
                "and/or vllm (docs/vllm.md); infer: each method on each, interleaved, speed-ups "
                "against the same runtime's uncompressed run (on llamacpp: plain llama.cpp, the "
                "base GGUF with no LoRA; on vllm: the same engine reading the prompt's own token "
                "rows); serve: a server per runtime (ktm serve --backend)"})
    presses: tuple[str, ...] = field(default=(), metadata={
        "help": "infer, torch: also read with these KV presses (NAME=RATIO, names as ktm "
                "generate --press), each on the uncompressed prompt and stacked on each K; "
                "their prefill and KV bytes as pressed"})
    compile: tuple[str, ...] = field(default=("auto",), metadata={
        "help": "infer, torch: the prefill and decode step compiled (on), eager (off) or where "
                "measured to pay (auto, ktm.decode.compiled); train: the LM body "
                "(ktm.training.compiled); several (off on) time each method both ways, "
                "interleaved, with the graphs compiled in each row"})
    weights: tuple[str, ...] = field(default=("native",), metadata={
        "help": "infer, torch: the LM's linear layers as loaded (native) or in int8 "
                "(ktm.core.int8); several (native int8) time each method both ways, "
                "interleaved"})
    uncompressed: bool = field(default=True, metadata={
        "help": "include the uncompressed baseline (needed for speed-ups)"})
    plain_gguf: str | None = field(default=None, metadata={
        "help": "infer, llamacpp: the GGUF plain llama.cpp runs for the uncompressed baseline "
                "(default: the model's base GGUF, e.g. the embedded Q4_1 file)"})
    output_tokens: int = field(default=32, metadata={
        "help": "tokens generated per sample for decode and end-to-end timings (infer)"})
    target_tokens: int = field(default=16, metadata={
        "help": "target tokens per sample, EOS excluded (train)"})
    repeats: int = field(default=5, metadata={"help": "timed repeats per method (medians)"})
    warmup: int = field(default=1, metadata={"help": "untimed passes over all methods first"})
    seed: int = field(default=0, metadata={"help": "seed of the synthetic prompts and encoders"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda[:i]"})
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    threads: int = field(default=0, metadata={
        "help": "torch CPU threads; 0 leaves torch's setting (it is recorded either way)"})
    out: str = field(default="results/bench/bench.json", metadata={
        "aliases": ["--json"], "help": "JSON result file"})  # --json: ktm eval's name
    quick: bool = field(default=False, metadata={
        "help": f"replace options left at their defaults with the quick preset {QUICK}"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    clients: tuple[int, ...] = field(default=(1, 4, 16), metadata={
        "help": f"serve: concurrent clients (serve mode's defaults: {SERVE}, quick {SERVE_QUICK})"})
    requests: int = field(default=32, metadata={
        "help": "serve: requests per (method, clients) point"})

    def __post_init__(self) -> None:
        self._preset()
        self._check_sizes()
        self._check_backends()
        self._check_runtime_options()
        check_at_least(self, 1, "output_tokens", "target_tokens", "repeats")
        check_at_least(self, 0, "warmup", "threads")
        parse_dtype(self.dtype)
        self._check_shape()
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise KTMError(f"device must be cpu or cuda[:i], got {self.device!r}")

    def _preset(self) -> None:
        """Options left at their defaults take the mode's preset (serve, hf, --quick)."""
        if self.mode == "serve":
            preset = {**SERVE, **(SERVE_QUICK if self.quick else {})}
        elif self.mode == "hf":
            preset = HF
        else:
            preset = QUICK if self.quick else {}
        # lengths nobody chose (the default or a preset's) are cut to the model's context later
        self.lengths_unchosen = self.lengths == BenchConfig.lengths
        for f in fields(self):
            if f.name in preset and getattr(self, f.name) == f.default:
                setattr(self, f.name, preset[f.name])

    def _check_sizes(self) -> None:
        self.clients = tuple(self.clients)
        if not self.clients or any(not isinstance(c, int) or c < 1 for c in self.clients):
            raise KTMError(f"clients must be integers >= 1, got {list(self.clients)}")
        check_at_least(self, 1, "requests")
        for name in ("lengths", "batch_sizes", "ks", "mlp_ratios"):
            setattr(self, name, tuple(getattr(self, name)))
            if not getattr(self, name):
                raise KTMError(f"{name} is empty: expected at least one value")
        if self.mode not in MODES:
            raise KTMError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("lengths", "batch_sizes", "ks"):
            bad = [v for v in getattr(self, name) if not isinstance(v, int) or v < 1]
            if bad:
                raise KTMError(f"{name} must be integers >= 1, got {bad}")
        check_at_least(self, 1, "inner_k")
        if self.inner_k > 1 and all(inner_of(k, self.inner_k) == 1 for k in self.ks):
            raise KTMError(f"inner_k {self.inner_k} divides none of ks {list(self.ks)} "
                           "(expected a K that it divides and is smaller than)")
        if any(r <= 0 for r in self.mlp_ratios):
            raise KTMError(f"mlp_ratios must be > 0, got {list(self.mlp_ratios)}")
        self.ratios = tuple(check_ratio(r, "each of ratios") for r in self.ratios)

    def _check_backends(self) -> None:
        self.backends = tuple(dict.fromkeys(self.backends))
        bad = [b for b in self.backends if b not in BACKENDS]
        if bad or not self.backends:
            raise KTMError(f"backends must be some of {BACKENDS}, got {list(self.backends)}")
        if self.backends != ("torch",) and self.mode == "train":
            raise KTMError("--backends is an option of --mode infer and serve (training runs "
                           "on torch)")
        if self.plain_gguf is not None and (self.mode != "infer"
                                            or "llamacpp" not in self.backends):
            raise KTMError("--plain-gguf is an option of --mode infer with --backends llamacpp")

    def _check_runtime_options(self) -> None:
        """Presses, compile modes and weight types: each refused where it does not run."""
        self.presses = tuple(self.presses)
        for spec in self.presses:
            press_of(spec)  # an unknown name or a bad ratio is refused now
        if self.presses and (self.mode != "infer" or "torch" not in self.backends):
            raise KTMError("--presses is an option of --mode infer on the torch backend (a "
                           "press runs on the torch runtime only)")
        self.compile = tuple(dict.fromkeys(self.compile))
        for mode in self.compile:
            check_compile(mode)
        if not self.compile:
            raise KTMError("compile is empty: expected at least one of auto, off, on")
        if self.compile != ("auto",) and self.mode not in ("infer", "train"):
            raise KTMError("--compile is an option of --mode infer (the prefill and decode "
                           "step) and train (the LM body)")
        self.weights = tuple(dict.fromkeys(self.weights))
        for w in self.weights:
            check_weights(w)
        if not self.weights:
            raise KTMError("weights is empty: expected at least one of native, int8")
        if self.weights != ("native",) and (self.mode != "infer" or "torch" not in
                                            self.backends):
            raise KTMError("--weights is an option of --mode infer on the torch backend (the "
                           "torch runtime's decoding)")

    def _check_shape(self) -> None:
        if self.shape is not None:
            from ktm.bench.shapes import shape_config

            if self.model != DEFAULT_MODEL:
                raise KTMError(f"--shape {self.shape!r} and --model {self.model!r}: expected "
                               "one (a shape times random weights of an architecture)")
            if self.backends != ("torch",):
                raise KTMError("--shape builds a torch model in-process: expected --backends "
                               "torch")
            if self.mode not in ("infer", "train"):
                raise KTMError(f"--shape is an option of --mode infer and train, got "
                               f"{self.mode!r}")
            shape_config(self.shape)  # an unknown shape is refused now, not after loading


def inner_of(k: int, inner_k: int) -> int:
    """The inner level ``--inner-k`` gives an encoder merging at ``k``: ``inner_k`` where it
    divides ``k`` and is smaller, else 1 (one level)."""
    return inner_k if k > inner_k and k % inner_k == 0 else 1


@dataclass(frozen=True)
class Method:
    name: str  # "uncompressed" or "ktm"
    k: int = 1
    mlp_ratio: float | None = None
    backend: str = "torch"
    ratio: float | None = None  # read at a ratio by the model's own levels (adaptive merging)
    press: str | None = None  # a KV press, NAME=RATIO (torch)
    compile: str = "auto"  # infer: the torch runtime's (ktm.decode.compiled); train: the body's
    weights: str = "native"  # infer: the torch runtime's linear layers (ktm.core.int8)

    @property
    def key(self) -> str:
        key = ("uncompressed" if self.name == "uncompressed" else f"ratio={self.ratio:g}"
               if self.ratio is not None else f"K={self.k},r={self.mlp_ratio}")
        key += f"+{self.press}" if self.press else ""
        key += f"+compile={self.compile}" if self.compile != "auto" else ""
        key += f"+{self.weights}" if self.weights != "native" else ""
        return key if self.backend == "torch" else f"{key}@{self.backend}"

    @property
    def baseline(self) -> str:
        """The key of the run its speed-ups are against: the same runtime, uncompressed, compiled
        the same way, with the same weights."""
        return Method("uncompressed", backend=self.backend, compile=self.compile,
                      weights=self.weights).key


# ---------------------------------------------------------------- aggregation
PAIRED = {"prefill_s": "speedup_prefill", "ttft_s": "speedup_ttft", "e2e_s": "speedup_e2e",
          "step_s": "speedup_train"}


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    if xs and all(x == xs[0] for x in xs):
        return xs[0]  # counts such as compressed tokens stay ints
    return statistics.median(xs) if xs else None


def aggregate(runs: dict[str, list[dict]], baseline: str | None = "uncompressed") -> dict:
    """Per method key: medians over repeats, plus speed-ups paired by repeat index.

    ``runs[key][r]`` is repeat r of method ``key``; speed-up = median_r(base[r] / method[r]) on
    the times in PAIRED, so a slow moment of the machine cancels within its own pair.
    """
    base = runs.get(baseline) if baseline else None
    out = {}
    for key, reps in runs.items():
        row: dict = {"per_repeat": {}}
        for name in reps[0]:
            if name == "tokens":
                continue
            values = [r[name] for r in reps]
            row["per_repeat"][name] = values
            row[name] = _median(values)
        if "encoder_s" in row:
            row["encoder_share"] = _median([r["encoder_s"] / r["prefill_s"] for r in reps])
        for t, s in PAIRED.items():
            if t in reps[0] and base is not None:
                if len(base) != len(reps):
                    raise KTMError(f"{key} has {len(reps)} repeats, baseline {len(base)}")
                ratios = [b[t] / r[t] for b, r in zip(base, reps)]
                row["per_repeat"][s] = ratios
                row[s] = statistics.median(ratios)
            elif t in reps[0]:
                row[s] = None
        if base is not None and "kv_cache_bytes" in row:
            row["kv_ratio"] = row["kv_cache_bytes"] / _median([b["kv_cache_bytes"] for b in base])
        out[key] = row
    return out


# ---------------------------------------------------------------- the run
def load_model(config: BenchConfig):
    """A KTMModel from a ktm checkpoint folder or a base model (name or HF folder)."""
    from ktm.model import KTMModel

    dtype, train = parse_dtype(config.dtype), config.mode == "train"
    k = config.ks[0]
    inner_k = inner_of(k, config.inner_k)
    if config.shape is not None:
        from ktm.bench.shapes import random_model

        lm, tok = random_model(config.shape, config.device, dtype, config.seed)
        model = KTMModel.from_base(lm, k=k, tokenizer=tok, mlp_ratio=config.mlp_ratios[0],
                                   inner_k=inner_k, device=config.device, dtype=dtype)
        return model if train else model.requires_grad_(False)
    from ktm.readers import READERS

    if (Path(config.model) / "ktm_config.json").is_file() or config.model in READERS:
        return KTMModel.load(config.model, device=config.device, dtype=dtype, trainable=train)
    model = KTMModel.from_base(config.model, k=k, mlp_ratio=config.mlp_ratios[0],
                               inner_k=inner_k, device=config.device, dtype=dtype)
    # infer times a model as it is served: frozen, as a loaded checkpoint (its decoding then
    # reads the LoRA folded into the weights, ``KTMModel.fold_lora``)
    return model if train else model.requires_grad_(False)


def methods_of(config: BenchConfig, top_k: int = 1) -> list[Method]:
    """The methods of a run; ``top_k``: the model's own K, which reads the ratio methods."""
    out = []
    for b in config.backends:
        out += [Method("uncompressed", backend=b)] if config.uncompressed else []
        out += [Method("ktm", k, r, b) for k in config.ks for r in config.mlp_ratios]
        out += [Method("ktm", top_k, None, b, ratio) for ratio in config.ratios]
    for spec in config.presses:  # the torch runtime's
        out += [Method("uncompressed", press=spec)]
        out += [Method("ktm", k, r, press=spec) for k in config.ks for r in config.mlp_ratios]
    if config.compile != ("auto",):  # each torch method once per decode step
        out = [replace(m, compile=c) if m.backend == "torch" else m
               for m in out for c in config.compile
               if m.backend == "torch" or c == config.compile[0]]
    if config.weights != ("native",):  # each torch method once per weights
        out = [replace(m, weights=w) if m.backend == "torch" else m
               for m in out for w in config.weights
               if m.backend == "torch" or w == config.weights[0]]
    return out


def press_of(spec: str | None) -> PressConfig | None:
    """A ``--presses`` entry, NAME=RATIO, as its ``PressConfig`` (None: none)."""
    return None if spec is None else PressConfig.parse(spec)


def bench_runtimes(model, config: BenchConfig) -> dict:
    """The runtimes by (backend, method name), each built for ``model`` (``RuntimeSpec.build``:
    the model's own runtime stays its own); torch runs on the model's own.

    llama.cpp: cells for the longest prompt and its answer in every row of the largest batch;
    ``ktm``, the model's own (exported once into the cache), and ``uncompressed``, plain
    llama.cpp (the base GGUF alone, no LoRA). vLLM: one engine in this process on the model's
    export (the LoRA merged into the LM), which both read: merged prompts and plain ones, whose
    every row is a token's own embedding."""
    own = model.runtime  # torch's
    runtimes = {("torch", "ktm"): own, ("torch", "uncompressed"): own}
    try:
        if "llamacpp" in config.backends:
            runtimes.update(_llamacpp_runtimes(model, config))
        if "vllm" in config.backends:
            from ktm.vllm.runtime import VLLMConfig

            engine = RuntimeSpec("vllm", vllm=VLLMConfig(max_num_seqs=max(config.batch_sizes))
                                 ).build(model)
            runtimes["vllm", "ktm"] = runtimes["vllm", "uncompressed"] = engine
    except BaseException:
        for rt in set(runtimes.values()) - {own}:
            rt.close()
        raise
    return runtimes


def _llamacpp_runtimes(model, config: BenchConfig) -> dict:
    from ktm.llamacpp.backend import export_dir
    from ktm.llamacpp.export import export_files
    from ktm.llamacpp.runtime import LlamaCppRuntime, RuntimeConfig

    cells = (max(config.lengths) + config.output_tokens + 8) * max(config.batch_sizes)
    rc = RuntimeConfig(context=cells, sequences=max(config.batch_sizes))
    runtimes = {("llamacpp", "ktm"): RuntimeSpec("llamacpp", llamacpp=rc).build(model)}
    try:
        if config.plain_gguf is not None:
            base = Path(config.plain_gguf).expanduser()
            if not base.is_file():
                raise KTMError(f"--plain-gguf {config.plain_gguf!r} is not a file: expected a "
                               "GGUF of the model's base")
        else:
            base, _ = export_files(export_dir(model, None, None), model, plain=True)
        runtimes["llamacpp", "uncompressed"] = LlamaCppRuntime(base, None, rc)
    except BaseException:
        runtimes["llamacpp", "ktm"].close()
        raise
    return runtimes


def _encoders(model, methods: list[Method], seed: int, inner_k: int = 1,
              train: bool = False) -> dict[str, KTokenEncoder | RecursiveEncoder]:
    """One encoder per merging method; a loaded checkpoint's own encoder is reused if its K and
    MLP width fit. A new one at a K that ``inner_k`` divides (and exceeds) is recursive. Outside
    ``train`` the encoders are frozen, as a served model's are: they then run in the LM's dtype
    (``cast_for_inference``) instead of being autocast on every call."""
    own, encs = model.encoder, {}
    torch.manual_seed(seed)
    for m in methods:
        if m.name == "uncompressed":
            continue
        if m.press is not None:  # its unpressed twin's encoder
            same = Method(m.name, m.k, m.mlp_ratio, m.backend, m.ratio).key
            if same in encs:
                encs[m.key] = encs[same]
                continue
        if m.ratio is not None:  # the model's own levels read every ratio
            encs[m.key] = own
            continue
        same = Method(m.name, m.k, m.mlp_ratio).key  # the torch twin's: one encoder for both
        if same in encs:
            encs[m.key] = encs[same]
        elif own.k == m.k and own.config.mlp_ratio == m.mlp_ratio and own.config.use_mlp:
            encs[m.key] = own
        else:
            wanted = EncoderConfig(own.config.hidden_size, m.k, m.mlp_ratio,
                                   inner_k=inner_of(m.k, inner_k))
            # fp32 like every trainable weight (the model autocasts it to the LM's dtype); made
            # on the model's device (a 7B model's K=4 encoder has 1.3B weights)
            with torch.device(model.device):
                encs[m.key] = KTokenEncoder.from_config(wanted).requires_grad_(train)
    return encs


def _optimizers(model, methods, encs) -> dict[str, torch.optim.Optimizer]:
    lora = [p for n, p in model.peft.named_parameters() if p.requires_grad]
    if not lora:
        raise KTMError("no trainable LoRA weights: train mode needs a trainable adapter")
    return {m.key: adamw(lora + (list(encs[m.key].parameters()) if m.key in encs else []),
                         lr=1e-6) for m in methods}


def memory_pass(run, methods: list[Method], stats: dict) -> None:
    """One untimed run per method on a trimmed heap; its peak memory replaces the timed ones.

    Timed runs reuse memory the allocator kept from earlier (bigger) runs, so their RSS says
    little about the method itself; trimming first would move page faults into the timings.
    """
    for m in methods:
        gc.collect()
        trim_allocator()
        res = run(m)
        for name in ("peak_mem_bytes", "peak_mem_delta_bytes"):
            stats[m.key][name] = res[name]
            stats[m.key]["per_repeat"].pop(name, None)


def _runner(model, config: BenchConfig, encs: dict, opts: dict, prompts: list[str],
            targets: list[str], runtimes: dict, compiles: Counter):
    """``compiles``: graphs compiled per method (infer: the torch runtime's prefill and decode
    step; train: the LM body, ``ktm.training.compiled``)."""
    ids = [model.tokenize(p, first=True) for p in prompts]  # tokenization stays untimed

    def run(m: Method) -> dict:
        if m.key in encs:
            model.encoder = encs[m.key]
        runtime = runtimes[m.backend, m.name]
        merge = m.name != "uncompressed"
        if config.mode == "infer":
            if m.backend == "torch":
                runtime.compile, runtime.weights = m.compile, m.weights
            before = runtime.compiles
            with pressed_as(runtime, press_of(m.press)):
                res = infer_once(model, ids, merge, config.output_tokens, ratio=m.ratio,
                                 runtime=runtime)
            compiles[m.key] += runtime.compiles - before
            return res
        before = graphs()
        res = train_once(model, opts[m.key], prompts, targets, merge, ratio=m.ratio,
                         compile=m.compile)
        compiles[m.key] += graphs() - before
        return res

    return run


def _fit_lengths(config: BenchConfig, model) -> None:
    """Lengths beyond the model's context: left out (said so) where nobody chose them (a local
    model of a shorter context than the embedded one's), refused where given (--lengths)."""
    extra = config.output_tokens if config.mode == "infer" else config.target_tokens + 1
    limit = getattr(model.peft.get_base_model().config, "max_position_embeddings", None)
    fit = tuple(n for n in config.lengths if not limit or n + extra <= limit)
    if getattr(config, "lengths_unchosen", False) and fit and fit != config.lengths:
        warnings.warn(f"bench: lengths {[n for n in config.lengths if n not in fit]} left out: "
                      f"beyond the model's context of {limit} positions", UserWarning,
                      stacklevel=3)
        config.lengths = fit
    if limit and max(config.lengths) + extra > limit:
        raise KTMError(f"length {max(config.lengths)} + {extra} generated/target tokens exceeds "
                       f"the model's context of {limit} positions")


def _row(model, config: BenchConfig, m: Method, enc, runtimes: dict, length: int, batch: int,
         compiles: int, stats: dict, common: dict) -> dict:
    """One method's result row at (``length``, ``batch``)."""
    return {
        "method": m.name, "k": m.k, "mlp_ratio": m.mlp_ratio, "backend": m.backend,
        **({m.backend: runtimes[m.backend, m.name].record()} if m.backend != "torch" else {}),
        "encoder_params": sum(p.numel() for p in enc.parameters()) if enc else 0,
        "input_tokens": length, "batch": batch, "repeats": config.repeats,
        **({"output_tokens": config.output_tokens} if config.mode == "infer"
           else {"target_tokens": config.target_tokens + 1}),
        "ratio": m.ratio, "press": m.press,
        # graphs compiled for this point, its untimed passes included
        **({"compile": m.compile, "compiles": compiles, "weights": m.weights}
           if m.backend == "torch" else {}),
        # the model's own allocator lays out a ratio row (its config's)
        "allocator": model.config.allocator if m.ratio is not None else None,
        "expected_compressed_tokens": (math.ceil(length / m.k) if m.ratio is None
                                       else round(length / m.ratio)),
        **stats,
        **(utilisation(model, enc, batch, stats, config) if config.mode == "train" else {}),
        **common}


def run_bench(config: BenchConfig, model=None) -> list[dict]:
    """Run every (length, batch) with all methods interleaved; one result row per method.
    ``model``: one ``load_model(config)`` made before (several runs of one large model)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    model = load_model(config) if model is None else model
    _fit_lengths(config, model)
    methods = methods_of(config, model.k)
    runtimes = bench_runtimes(model, config)
    encs = _encoders(model, methods, config.seed, config.inner_k, config.mode == "train")
    opts = _optimizers(model, methods, encs) if config.mode == "train" else {}
    pool = word_pool(model.tokenizer, config.seed)
    common = {"mode": config.mode, "model": config.model, "device": str(model.device),
              **({"shape": config.shape, "random_weights": True} if config.shape else {}),
              **({"device_name": torch.cuda.get_device_name(model.device)}
                 if model.device.type == "cuda" else {}),
              "dtype": config.dtype, "threads": torch.get_num_threads(),
              "mem_kind": "cuda_max_allocated" if model.device.type == "cuda" else "rss",
              "config": asdict(config), "versions": versions(), "git": git_revision()}
    per_point = (config.warmup + config.repeats + 1) * len(methods)
    bar = tqdm(total=len(config.lengths) * len(config.batch_sizes) * per_point,
               desc=f"bench {config.mode}", disable=not config.progress)
    rows = []
    try:
        for length in config.lengths:
            for batch in config.batch_sizes:
                seeds = [config.seed * 1_000_003 + length * 1009 + i for i in range(batch)]
                prompts = [synthetic_text(model, length, s, pool) for s in seeds]
                targets = [synthetic_text(model, config.target_tokens, s + 1, pool, first=False)
                           for s in seeds]
                compiles = Counter()
                run = _runner(model, config, encs, opts, prompts, targets, runtimes, compiles)
                runs = interleave(run, methods, config.warmup, config.repeats, bar.update)
                stats = {}
                # speed-ups against the same runtime, uncompressed, compiled the same way
                for base in dict.fromkeys(m.baseline for m in methods):
                    stats.update(aggregate({m.key: runs[m.key] for m in methods
                                            if m.baseline == base},
                                           base if config.uncompressed else None))
                memory_pass(run, methods, stats)
                bar.update(len(methods))
                rows += [_row(model, config, m, encs.get(m.key), runtimes, length, batch,
                              compiles[m.key], stats[m.key], common) for m in methods]
    finally:
        bar.close()
        own = runtimes["torch", "ktm"]
        for rt in set(runtimes.values()) - {own}:  # vLLM's one engine serves two methods
            rt.close()
    return rows


def utilisation(model, encoder, batch: int, row: dict, config: BenchConfig) -> dict:
    """A train row's model FLOPs per step, their rate and MFU (``ktm.bench.flops``)."""
    from ktm.bench.flops import peak_tflops, train_step_flops

    merged = row["compressed_tokens"]
    targets = config.target_tokens + 1  # EOS
    flops = train_step_flops(model, encoder, batch, merged + targets, targets,
                             merged if encoder is not None else 0)
    peak, _ = peak_tflops(model.device, model.dtype)
    rate = flops / row["step_s"] / 1e12
    return {"model_flops_per_step": flops, "model_tflops_per_s": rate,
            "peak_tflops": peak, "mfu": rate / peak if peak else None}


# ---------------------------------------------------------------- entry points
COLUMNS = {
    "infer": [("method", "{}"), ("backend", "{}"), ("k", "{}"), ("ratio", "{:g}"),
              ("press", "{}"), ("compile", "{}"), ("weights", "{}"),
              ("mlp_ratio", "{}"),
              ("input_tokens", "{}"), ("compressed_tokens", "{}"), ("batch", "{}"),
              ("encoder_s", "{:.3f}"),
              ("prefill_s", "{:.3f}"), ("encoder_share", "{:.0%}"), ("ttft_s", "{:.3f}"),
              ("decode_tokens_per_s", "{:.1f}"), ("e2e_s", "{:.2f}"),
              ("kv_ratio", "{:.3f}"), ("speedup_prefill", "{:.2f}x"), ("speedup_e2e", "{:.2f}x")],
    "train": [("method", "{}"), ("k", "{}"), ("compile", "{}"), ("mlp_ratio", "{}"),
              ("input_tokens", "{}"), ("compressed_tokens", "{}"), ("batch", "{}"),
              ("step_s", "{:.3f}"),
              ("input_tokens_per_s", "{:.0f}"), ("model_tflops_per_s", "{:.1f}"),
              ("mfu", "{:.1%}"), ("speedup_train", "{:.2f}x")],
    "serve": [("method", "{}"), ("backend", "{}"), ("k", "{}"),
              ("input_tokens", "{}"),
              ("prompt_tokens_merged", "{}"), ("clients", "{}"), ("requests_per_s", "{:.2f}"),
              ("latency_p50_s", "{:.2f}"), ("latency_p95_s", "{:.2f}"), ("ttft_p50_s", "{:.2f}"),
              ("ttft_p95_s", "{:.2f}"), ("output_tokens_per_s", "{:.1f}")],
    "hf": [("method", "{}"), ("input_tokens", "{}"), ("output_tokens", "{}"), ("batch", "{}"),
           ("ttft_s", "{:.3f}"), ("decode_tokens_per_s", "{:.2f}"), ("e2e_s", "{:.2f}"),
           ("vs_hf_decode", "{:.3f}x"), ("vs_hf_e2e", "{:.3f}x"), ("same_tokens_as_hf", "{}")],
    "serve-prefix": [("backend", "{}"), ("k", "{}"), ("input_tokens", "{}"),
                     ("cached_positions", "{}"),
                     ("ttft_uncached_s", "{:.3f}"), ("ttft_cached_s", "{:.3f}"),
                     ("speedup_ttft_cached", "{:.1f}x")],
}


def _table_kind(row: dict) -> str:
    return "serve-prefix" if row.get("kind") == "prefix" else row["mode"]


def format_table(rows: list[dict]) -> str:
    """Markdown table of the main columns (numbers are formatted only here)."""
    tables = []
    for kind in dict.fromkeys(_table_kind(r) for r in rows):
        cols, part = COLUMNS[kind], [r for r in rows if _table_kind(r) == kind]
        cell = [[("-" if r.get(c) is None else fmt.format(r[c])) for c, fmt in cols]
                for r in part]
        lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
        tables.append("\n".join(lines + ["| " + " | ".join(c) + " |" for c in cell]))
    return "\n\n".join(tables)


def main_bench(config: BenchConfig) -> int:
    """Run, write the JSON rows atomically, print a table. A ``KTMError`` propagates: the CLI
    prints it as ``ktm: error: ...`` like every other command."""
    check_writable(config.out)  # refused now, not after the benchmark
    if config.mode == "serve":
        from ktm.bench.serve import run_serve_bench

        rows = run_serve_bench(config)
    elif config.mode == "hf":
        from ktm.bench.versus_hf import run_hf_bench

        rows = run_hf_bench(config, load_model)
    else:
        rows = run_bench(config)
    write_json_atomic(config.out, rows)
    print(format_table(rows))
    print(f"wrote {len(rows)} rows to {config.out}")
    return 0
