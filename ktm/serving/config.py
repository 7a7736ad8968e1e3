"""``ktm serve`` options: the dataclass is the CLI (``ktm serve --help``, its flags in the groups
of their fields' ``metadata["group"]``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from ktm.core.base_model import parse_dtype
from ktm.core.config import DEFAULT_MODEL, QUOTE_MODES, Layout
from ktm.errors import KTMError
from ktm.model import RuntimeSpec
from ktm.serving.history import check_history_press
from ktm.util.field_types import check_at_least


@dataclass
class ServeConfig:
    model: str = field(default=DEFAULT_MODEL, metadata={
        "group": "model",
        "help": "embedded model name, HF folder (served with an untrained mean-pooling merger), "
                "ktm checkpoint folder or shipped reader name"})
    k: int | None = field(default=None, metadata={
        "group": "model",
        "help": "tokens merged per block: a base model's K (default 4); a checkpoint's K if given "
                "must match"})
    quote: str | None = field(default=None, metadata={
        "group": "model",
        "help": "a question reader's lines the question asks about: far (read in place) or all "
                "(the document read as without a question, the lines quoted after it: its KV "
                "cached once serves every question) (KTMConfig.quote; default: the reader's)"})
    host: str = field(default="127.0.0.1", metadata={"group": "server",
                                                      "help": "address to listen on"})
    port: int = field(default=8000, metadata={"group": "server", "help": "port to listen on"})
    served_name: str | None = field(default=None, metadata={
        "group": "model",
        "help": "model id clients send (default: the --model value's last path part)"})
    max_batch: int = field(default=16, metadata={
        "group": "batching", "help": "requests decoding together at most"})
    batch_window_ms: float = field(default=10.0, metadata={
        "group": "batching",
        "help": "an idle server waits this long after a request for others to prefill with it"})
    max_tokens_limit: int = field(default=1024, metadata={
        "group": "batching",
        "help": "largest max_tokens a request may ask for (also the chat default)"})
    max_queue: int = field(default=256, metadata={
        "group": "batching",
        "help": "requests waiting beyond this get 503 (server busy)"})
    prefix_cache_mb: float = field(default=512.0, metadata={
        "group": "batching",
        "help": "memory for reused merged segments and context KV (0: off)"})
    # where the model runs: RuntimeSpec's flags (--backend, --gguf, --llamacpp-*, --vllm-*,
    # --press, --press-ratio, --compile, --weights); a request's ktm field may name another
    # press, or none. One llama.cpp sequence per request decoding at once, as many requests as
    # vLLM decodes: both are --max-batch here.
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec, metadata={"group": "runtime",
                                                                        "prefix": ""})
    history_budget: int | None = field(default=None, metadata={
        "group": "chat history",
        "help": "chats are read within this many positions: a message without its own ktm "
                "field is read plain while the chat fits, and the oldest are merged (whole, at "
                "K) as it grows past it; system messages and the newest user message stay "
                "plain (a request's ktm.history_budget overrides it; default: no budget)"})
    history_press: str | None = field(default=None, metadata={
        "group": "chat history",
        "help": "with --history-budget, on the torch backend: a chat over its budget reads its "
                "older messages plain and presses their KV to fit with this kvpress press (names "
                "as --press), instead of merging them; a request's ktm.history_press overrides "
                "it ('none': merge) (default: merge)"})
    history_ahead: bool = field(default=False, metadata={
        "group": "chat history",
        "help": "after each chat answer, read the chat's next turn up to its new message while "
                "the client is idle (the answer, and the history as that turn will merge it, "
                "guessing a next message as long as the last), so that turn reads little more "
                "than its new message, also where --history-budget merges more of it: one "
                "more prefill per answer"})
    device: str = field(default="cpu", metadata={"group": "model", "help": "torch device"})
    dtype: str = field(default="float32", metadata={
        "group": "model", "help": "float32 | bfloat16 | float16"})
    threads: int = field(default=0, metadata={
        "group": "server", "help": "torch CPU threads (0: torch's choice)"})
    log_level: str = field(default="info", metadata={
        "group": "server",
        "help": "uvicorn log level", "choices": ["critical", "error", "warning", "info", "debug"]})
    # what a server others can reach needs (docs/serving.md, Deploying)
    api_key: tuple[str, ...] = field(default=(), repr=False, metadata={
        "group": "server",
        "repeat": True,
        "help": "a key every /v1 request must carry as 'Authorization: Bearer KEY' (401 "
                "without it; /health and /metrics stay open); repeat for several; default: "
                "$KTM_API_KEY if set, which keeps the key out of the process list, else none"})
    max_request_mb: float | None = field(default=None, metadata={
        "group": "server",
        "help": "request bodies over this many MiB get 413 before they are read (default: "
                "room for the longest prompt the model reads: its context x K x 64 bytes, at "
                "least 1 MiB)"})
    shutdown_timeout: float = field(default=30.0, metadata={
        "group": "server",
        "help": "on SIGTERM or Ctrl-C: seconds the requests in flight get to finish before "
                "they end with an error (a stream with an error event); new ones get 503"})

    def __post_init__(self) -> None:
        if self.k is not None and self.k < 1:
            raise KTMError(f"k must be an integer >= 1, got {self.k}")
        if self.quote is not None and self.quote not in QUOTE_MODES:
            raise KTMError(f"quote must be one of {', '.join(QUOTE_MODES)}, got {self.quote!r}")
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
        check_history_press(self.history_press, self.history_budget, self.runtime.press)
        if self.history_press is not None:
            from ktm.decode.press import PressConfig, press_refusal

            if self.runtime.backend != "torch":
                raise KTMError(press_refusal(self.runtime.backend, self.history_press))
            PressConfig(self.history_press)  # refused now, by name
        if self.served_name is None:
            self.served_name = Path(self.model.rstrip("/")).name or self.model
        if not self.served_name:
            raise KTMError("served_name is empty: expected the model id clients will send")


def load_served_model(cfg: ServeConfig):
    from ktm.llamacpp.runtime import RuntimeConfig
    from ktm.model import load_any
    from ktm.vllm.runtime import VLLMConfig

    check_servable(cfg.model)
    spec = cfg.runtime
    spec = replace(spec, llamacpp=replace(spec.llamacpp or RuntimeConfig(),
                                          sequences=cfg.max_batch),
                   vllm=replace(spec.vllm or VLLMConfig(), max_num_seqs=cfg.max_batch))
    return load_any(cfg.model, cfg.k, cfg.device, cfg.dtype, runtime=spec,
                    layout=Layout(quote=cfg.quote))


def check_servable(model: str) -> None:
    """Refuse, before loading, a checkpoint trained on prompts a baseline rewrote: the server
    reads every prompt as given, which for it is silently another model."""
    from ktm.compressors.record import refuse_rewritten

    refuse_rewritten(model, "the server", "ktm eval and ktm generate apply its method")
