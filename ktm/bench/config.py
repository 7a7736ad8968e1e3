"""The benchmark's settings: ``BenchConfig`` (``ktm bench``'s flags, its presets and checks),
and the methods a run times (``Method``, ``methods_of``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from ktm.core.base_model import parse_dtype
from ktm.core.config import DEFAULT_MODEL, check_ratio
from ktm.core.int8 import check_weights
from ktm.decode.compiled import check_mode as check_compile
from ktm.decode.press import PressConfig
from ktm.errors import KTMError
from ktm.model import BACKENDS
from ktm.util.field_types import check_at_least

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
        self.compile = _distinct("compile", self.compile, check_compile, "auto, off, on")
        if self.compile != ("auto",) and self.mode not in ("infer", "train"):
            raise KTMError("--compile is an option of --mode infer (the prefill and decode "
                           "step) and train (the LM body)")
        self.weights = _distinct("weights", self.weights, check_weights, "native, int8")
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


def _distinct(name: str, values, check, expected: str) -> tuple:
    """``values`` without repeats, each checked, at least one (``expected``: the choices)."""
    values = tuple(dict.fromkeys(values))
    for v in values:
        check(v)
    if not values:
        raise KTMError(f"{name} is empty: expected at least one of {expected}")
    return values
