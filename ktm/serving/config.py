"""``ktm serve`` options: the dataclass is the CLI (``ktm serve --help``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ktm.core.base_model import parse_dtype
from ktm.core.config import DEFAULT_MODEL
from ktm.errors import KTMError
from ktm.serving.history import check_history_press
from ktm.util.field_types import check_at_least


@dataclass
class ServeConfig:
    model: str = field(default=DEFAULT_MODEL, metadata={
        "help": "embedded model name, HF folder (served with an untrained mean-pooling merger), "
                "ktm checkpoint folder or shipped reader name"})
    k: int | None = field(default=None, metadata={
        "help": "tokens merged per block: a base model's K (default 4); a checkpoint's K if given "
                "must match"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    served_name: str | None = field(default=None, metadata={
        "help": "model id clients send (default: the --model value's last path part)"})
    max_batch: int = field(default=16, metadata={"help": "requests decoding together at most"})
    batch_window_ms: float = field(default=10.0, metadata={
        "help": "an idle server waits this long after a request for others to prefill with it"})
    max_tokens_limit: int = field(default=1024, metadata={
        "help": "largest max_tokens a request may ask for (also the chat default)"})
    max_queue: int = field(default=256, metadata={
        "help": "requests waiting beyond this get 503 (server busy)"})
    prefix_cache_mb: float = field(default=512.0, metadata={
        "help": "memory for reused merged segments and context KV (0: off)"})
    backend: str = field(default="torch", metadata={
        "help": "what prefills and decodes: torch; llamacpp (the [llamacpp] extra; the model "
                "is exported to GGUF once, into the cache, unless --gguf names an export); or "
                "vllm (exported once into the cache; this server merges prompts and forwards "
                "them to vLLM)",
        "choices": ["torch", "llamacpp", "vllm"]})
    gguf: str | None = field(default=None, metadata={
        "help": "a GGUF export of the model (ktm export --format gguf) for --backend llamacpp"})
    llamacpp_context: int | None = field(default=None, metadata={
        "help": "llama.cpp KV-cache cells shared by all running requests (default: the model's "
                "trained context, at most 16384)"})
    llamacpp_kv_type: str = field(default="f16", metadata={
        "help": "llama.cpp KV-cache type", "choices": ["f16", "f32"]})
    llamacpp_deterministic: bool = field(default=False, metadata={
        "help": "llama.cpp: greedy output independent of other requests and of what ran before "
                "(cells per sequence, no reused rows, a decode batch per row; slower under "
                "load)"})
    vllm_url: str | None = field(default=None, metadata={
        "help": "--backend vllm: a running vLLM server's /v1 address serving this model's "
                "export (default: vLLM runs in this process)"})
    vllm_server: bool = field(default=False, metadata={
        "help": "--backend vllm: start a vLLM server process instead of an engine in this one"})
    vllm_kv_cache_gb: float = field(default=1.0, metadata={
        "help": "--backend vllm: its CPU KV cache in GiB"})
    press: str | None = field(default=None, metadata={
        "help": "a kvpress press on every request's compressed segments' KV after prefill "
                "(torch backend only; a request's ktm field may name another, or none); names "
                "as ktm generate --press"})
    press_ratio: float = field(default=0.5, metadata={
        "help": "--press: the share of the pressed KV dropped, in [0, 1)"})
    history_budget: int | None = field(default=None, metadata={
        "help": "chats are read within this many positions: a message without its own ktm "
                "field is read plain while the chat fits, and the oldest are merged (whole, at "
                "K) as it grows past it; system messages and the newest user message stay "
                "plain (a request's ktm.history_budget overrides it; default: no budget)"})
    history_press: str | None = field(default=None, metadata={
        "help": "with --history-budget, on the torch backend: a chat over its budget reads its "
                "older messages plain and presses their KV to fit with this kvpress press (names "
                "as --press), instead of merging them; a request's ktm.history_press overrides "
                "it ('none': merge) (default: merge)"})
    history_ahead: bool = field(default=False, metadata={
        "help": "after each chat answer, read the chat's next turn up to its new message while "
                "the client is idle (the answer, and the history as that turn will merge it, "
                "guessing a next message as long as the last), so that turn reads little more "
                "than its new message, also where --history-budget merges more of it: one "
                "more prefill per answer"})
    compile: str = field(default="auto", metadata={
        "help": "--backend torch: the running batch decodes on a static KV cache, compiled "
                "(torch.compile; CUDA graphs on CUDA), its rows padded to a power of two so "
                "that requests joining and leaving compile nothing new: on or off; auto is "
                "eager here (not yet timed on a GPU; docs/serving.md)",
        "choices": ["auto", "off", "on"]})
    weights: str = field(default="native", metadata={
        "help": "--backend torch: the LM's linear layers as loaded (native) or in int8, one "
                "scale per output row (ktm.core.int8)", "choices": ["native", "int8"]})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    dtype: str = field(default="float32", metadata={"help": "float32 | bfloat16 | float16"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's choice)"})
    log_level: str = field(default="info", metadata={
        "help": "uvicorn log level", "choices": ["critical", "error", "warning", "info", "debug"]})
    # what a server others can reach needs (docs/serving.md, Deploying)
    api_key: tuple[str, ...] = field(default=(), repr=False, metadata={
        "repeat": True,
        "help": "a key every /v1 request must carry as 'Authorization: Bearer KEY' (401 "
                "without it; /health and /metrics stay open); repeat for several; default: "
                "$KTM_API_KEY if set, which keeps the key out of the process list, else none"})
    max_request_mb: float | None = field(default=None, metadata={
        "help": "request bodies over this many MiB get 413 before they are read (default: "
                "room for the longest prompt the model reads: its context x K x 64 bytes, at "
                "least 1 MiB)"})
    shutdown_timeout: float = field(default=30.0, metadata={
        "help": "on SIGTERM or Ctrl-C: seconds the requests in flight get to finish before "
                "they end with an error (a stream with an error event); new ones get 503"})

    def __post_init__(self) -> None:
        if self.k is not None and self.k < 1:
            raise KTMError(f"k must be an integer >= 1, got {self.k}")
        if not 0 <= self.port <= 65535:
            raise KTMError(f"port must be in 0..65535, got {self.port}")
        check_at_least(self, 1, "max_batch", "max_tokens_limit", "max_queue")
        check_at_least(self, 0, "batch_window_ms", "prefix_cache_mb", "threads",
                       "shutdown_timeout")
        if self.max_request_mb is not None and not self.max_request_mb > 0:
            raise KTMError(f"max_request_mb must be a number of MiB > 0, got "
                           f"{self.max_request_mb!r}")
        self.api_key = tuple(self.api_key or ()) or tuple(
            k for k in [os.environ.get("KTM_API_KEY", "")] if k)
        for i, key in enumerate(self.api_key):  # the key itself is never written out
            if not key or not key.isprintable() or key != key.strip() or not key.isascii():
                raise KTMError(f"api key #{i + 1} is empty or holds whitespace, control or "
                               "non-ASCII characters: expected printable ASCII, as an HTTP "
                               "header carries it")
        if self.history_budget is not None:
            check_at_least(self, 1, "history_budget")
        parse_dtype(self.dtype)
        if self.press is not None:
            from ktm.decode.press import PressConfig

            PressConfig(self.press, self.press_ratio)  # refused now, by name
        check_history_press(self.history_press, self.history_budget, self.press)
        from ktm.decode.compiled import check_mode

        check_mode(self.compile)
        if self.compile != "auto" and self.backend != "torch":
            raise KTMError(f"compile={self.compile!r} is an option of the torch backend, not "
                           f"{self.backend} (llama.cpp and vLLM run their own graphs)")
        from ktm.core.int8 import check_weights

        check_weights(self.weights)
        if self.weights != "native" and self.backend != "torch":
            raise KTMError(f"weights={self.weights!r} is an option of the torch backend, not "
                           f"{self.backend} (llama.cpp and vLLM read their own weight types)")
        if self.history_press is not None:
            from ktm.decode.press import PressConfig, press_refusal

            if self.backend != "torch":
                raise KTMError(press_refusal(self.backend, self.history_press))
            PressConfig(self.history_press)  # refused now, by name
        if self.served_name is None:
            self.served_name = Path(self.model.rstrip("/")).name or self.model
        if not self.served_name:
            raise KTMError("served_name is empty: expected the model id clients will send")


def load_served_model(cfg: ServeConfig):
    from ktm.model import load_any

    check_servable(cfg.model)
    settings = None
    if cfg.backend == "llamacpp":
        from ktm.llamacpp.runtime import RuntimeConfig

        # one llama.cpp sequence per request decoding at once
        settings = RuntimeConfig(context=cfg.llamacpp_context, sequences=cfg.max_batch,
                                 kv_type=cfg.llamacpp_kv_type,
                                 deterministic=cfg.llamacpp_deterministic)
    elif cfg.backend == "vllm":
        from ktm.vllm.runtime import VLLMConfig

        settings = VLLMConfig(url=cfg.vllm_url, server=cfg.vllm_server,
                              kv_cache_gb=cfg.vllm_kv_cache_gb, max_num_seqs=cfg.max_batch)
    model = load_any(cfg.model, cfg.k, cfg.device, cfg.dtype, press=cfg.press,
                     press_ratio=cfg.press_ratio)
    if cfg.backend != "torch":
        # a checkpoint folder that is a GGUF export serves its own files
        source = Path(cfg.model) if Path(cfg.model).is_dir() else None
        model.use_backend(cfg.backend, source=source, gguf=cfg.gguf, config=settings)
    return model


def check_servable(model: str) -> None:
    """Refuse, before loading, a checkpoint trained on prompts a baseline rewrote: the server
    reads every prompt as given, which for it is silently another model."""
    from ktm.compressors.record import refuse_rewritten

    refuse_rewritten(model, "the server", "ktm eval and ktm generate apply its method")
