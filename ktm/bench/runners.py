"""The benchmark's runners: the model a run times, the runtimes it built for it (each its own,
the model's left as it is), the encoders and optimizers of each method, and one timed pass of a
method (``_runner``)."""

from __future__ import annotations

import gc
from collections import Counter
from pathlib import Path

import torch

from ktm.bench.config import BenchConfig, Method, inner_of, press_of
from ktm.bench.measure import (
    infer_once,
    train_once,
    trim_allocator,
)
from ktm.core.base_model import parse_dtype
from ktm.core.encoder import EncoderConfig, KTokenEncoder, RecursiveEncoder
from ktm.decode.compiled import graphs
from ktm.decode.press import pressed_as
from ktm.errors import KTMError
from ktm.model import RuntimeSpec
from ktm.training.train import adamw


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
