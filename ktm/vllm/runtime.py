"""The vLLM runtime: a merged prefix prefilled and its answer decoded by vLLM.

ktm's decode loop (``ktm.decode.generate.decode_steps``) and the serving engine ask a runtime to
``prefill`` a batch of prefixes, ``advance`` it one token per row, ``keep`` some rows, ``join``
two batches and ``release`` one; ``score`` gives the log-probabilities of target tokens. vLLM owns
its own step loop and samples inside it, so this runtime hands each prefix to vLLM as a request
(``prompt_embeds``: the merged vectors and the plain tokens' table rows) with the sampling settings
of its row, and answers each step with the token vLLM chose: the row's logits are 0 at that token
and -inf elsewhere, so the loop's greedy or sampled choice is that token, and end-of-sequence,
stop strings and streaming stay the loop's own. A row the loop drops is aborted in vLLM.

Where vLLM runs:
- ``VLLMEngine``: an engine in this process (``vllm.LLM``'s engine, stepped by the caller);
- ``VLLMServer``: an OpenAI-compatible vLLM server, one this runtime starts or one the user points
  at (``--vllm-url``: tensor or pipeline parallel, several nodes); each request streams its token
  ids (``return_token_ids``) on a thread of its own.

vLLM places ``prompt_embeds`` at consecutive positions and scales nothing: a spread-position model
is refused (``ktm.vllm.export``).
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import math
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ktm.errors import KTMError
from ktm.util.own_engine import OwnEngine
from ktm.vllm.export import LM_DIR, LORA_ROWS, read_manifest
from ktm.vllm.install import check_vllm, server_command


@dataclass(frozen=True)
class VLLMConfig:
    """Where and how vLLM runs an export. ``url``: a running vLLM server's ``/v1`` address (None:
    ktm starts vLLM: in this process, or as a server when ``server``); ``kv_cache_gb``: the CPU
    build's KV cache (``VLLM_CPU_KVCACHE_SPACE``); ``max_num_seqs``: requests vLLM decodes at
    once; ``max_model_len``: positions per request (None: the model's, at most 8,192);
    ``eager``: no ``torch.compile`` (starts in about 24 s instead of 70 on a CPU); ``timeout``:
    seconds a server may take to answer a step (and to start)."""

    # ("flag": None: a setting of the library only, no command-line flag)
    url: str | None = field(default=None, metadata={
        "metavar": "URL", "help": "--backend vllm: a running vLLM server's /v1 address serving "
                                  "this model's export (None: vLLM runs in this process)"})
    server: bool = field(default=False, metadata={
        "help": "--backend vllm: start a vLLM server process instead of an engine in this "
                "process"})
    kv_cache_gb: float = field(default=1.0, metadata={
        "metavar": "GB", "help": "--backend vllm: its CPU KV cache"})
    max_num_seqs: int = field(default=16, metadata={"flag": None})
    max_model_len: int | None = field(default=None, metadata={"flag": None})
    eager: bool = field(default=True, metadata={"flag": None})
    timeout: float = field(default=300.0, metadata={"flag": None})

    def __post_init__(self) -> None:
        if self.url is not None and self.server:
            raise KTMError("give a vLLM server's url or ask for one to be started, not both")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise KTMError(f"vLLM url must be an http(s) address such as "
                           f"http://127.0.0.1:8000/v1, got {self.url!r}")
        if not 0 < self.kv_cache_gb < math.inf:
            raise KTMError(f"vLLM kv_cache_gb must be a number > 0, got {self.kv_cache_gb!r}")
        for name in ("max_num_seqs", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise KTMError(f"vLLM {name} must be an integer >= 1, got {v!r}")
        if not 0 < self.timeout < math.inf:
            raise KTMError(f"vLLM timeout must be a number of seconds > 0, got {self.timeout!r}")


@dataclass
class VLLMState:
    """A batch being decoded by vLLM: one request per row, and the token each row reads next."""

    ids: list[str]
    logits: torch.Tensor  # (B, V): 0 at the token vLLM chose, -inf elsewhere
    chosen: list[int | None]  # that token; None once vLLM has finished the row
    reused: list[int] = field(default_factory=list)  # prefix rows vLLM found cached (unknown: 0)
    positions: list[int] = field(default_factory=list)  # positions each row has read


class VLLMRuntime(OwnEngine):
    """What both transports share: the rows' requests, their tokens and the one-hot logits. The
    KV cache, graphs and weight types are vLLM's (``OwnEngine``: no press, nothing of ktm's
    compiled)."""

    name = "vllm"
    gives_logits = False  # a row's logits single out vLLM's choice: no distribution to report
    joinable = True  # each row is a request of its own
    rereads = False  # no use_cache=False: the cache is always kept
    prefix_kv = None  # cached prefixes live in its own KV cache

    def __init__(self, export_dir: str | Path, config: VLLMConfig, eos_ids, pad_id: int):
        # a remote server needs the export only; vLLM runs there
        self.version = check_vllm() if config.url is None else None
        self.dir = Path(export_dir)
        self.manifest = m = read_manifest(self.dir)
        self.lm_config = json.loads((self.dir / LM_DIR / "config.json").read_text())
        self.config = config
        self.eos, self.pad = sorted(eos_ids), pad_id
        self.width = int(m.get("embedding_size", m["hidden_size"]))
        self.n_vocab = int(m["vocab_size"])
        self.dtype = getattr(torch, m["dtype"])
        self.context: int | None = None  # KV cells the engine admits requests by (None: vLLM's own)
        self._ids = itertools.count()
        self._tokens: dict[str, deque[int]] = {}
        self._done: set[str] = set()
        self._errors: dict[str, str] = {}  # requests that ended in a failure, not a finish

    # ---- the calls of ktm's decode loop and serving engine -----------------------------------

    def prefill(self, prefixes, sampling=None, contexts=None, joinable: bool = False
                ) -> VLLMState:
        """Hand each prefix (a ``CompressedPrompt``) to vLLM with its row's sampling settings
        (``GenerationConfig``s; None: greedy, 1 token); returns once every row has its first.
        vLLM finds cached prefixes itself (``contexts`` is not needed), and every batch can be
        joined."""
        rows = [self._rows(cp) for cp in prefixes]  # every row checked before any is sent
        ids = []
        try:
            for r, cfg in zip(rows, sampling or [None] * len(rows)):
                rid = f"ktm-{next(self._ids)}"
                self._tokens[rid] = deque()
                ids.append(rid)
                self._submit(rid, r, cfg)
            chosen = self._next(ids)
        except BaseException:
            self._drop(ids)
            raise
        return VLLMState(ids, self._one_hot(chosen), chosen, [0] * len(ids),
                         [r.shape[0] for r in rows])

    def advance(self, state: VLLMState, tokens: torch.Tensor) -> None:
        """The loop read ``tokens`` (B,): each row's next token from vLLM."""
        for j, (tok, want) in enumerate(zip(tokens.tolist(), state.chosen)):
            if want is not None and tok != want:
                raise KTMError(f"vLLM decodes its own tokens: row {j} was fed token {tok}, but "
                               f"vLLM chose {want}")
        state.chosen = self._next(state.ids)
        state.logits = self._one_hot(state.chosen)
        state.positions = [p + 1 for p in state.positions]

    def join(self, a: VLLMState, b: VLLMState) -> VLLMState:
        return VLLMState(a.ids + b.ids, torch.cat([a.logits, b.logits]), a.chosen + b.chosen,
                         a.reused + b.reused, a.positions + b.positions)

    def keep(self, state: VLLMState, rows: list[int]) -> None:
        """Drop every row not in ``rows``: its request is aborted (a stop string, a client gone)."""
        self._drop([rid for j, rid in enumerate(state.ids) if j not in rows])
        state.ids = [state.ids[j] for j in rows]
        state.chosen = [state.chosen[j] for j in rows]
        state.reused = [state.reused[j] for j in rows]
        state.positions = [state.positions[j] for j in rows]
        state.logits = state.logits[rows]

    def release(self, state: VLLMState | None) -> None:
        if state is not None:
            self._drop(state.ids)

    # ---- shared ------------------------------------------------------------------------------

    def _rows(self, cp) -> torch.Tensor:
        """A prefix's rows in the export's dtype, checked for what vLLM reads."""
        embeds = cp.embeds.detach().to("cpu")
        if embeds.dim() != 2 or embeds.shape[1] != self.width:
            raise KTMError(f"prefix rows are {tuple(embeds.shape)}, but the vLLM export reads "
                           f"{self.width}-wide input embeddings: expected (L, {self.width})")
        if not bool(torch.isfinite(embeds).all()):
            raise KTMError("prefix rows hold NaN or inf values: expected finite embeddings")
        if cp.positions is not None and not torch.equal(cp.positions.cpu(),
                                                        torch.arange(embeds.shape[0])):
            raise KTMError("vLLM reads prompt_embeds at consecutive positions, but this prompt's "
                           "are spread: expected a model with consecutive positions (e.g. the "
                           "reader smollm2-135m-k4-seq)")
        return embeds.to(self.dtype).contiguous()

    def _one_hot(self, chosen: list[int | None]) -> torch.Tensor:
        logits = torch.full((len(chosen), self.n_vocab), -math.inf)
        for j, tok in enumerate(chosen):
            logits[j, self.pad if tok is None else tok] = 0.0
        return logits

    def _params(self, cfg) -> dict:
        """vLLM sampling settings of a row (``GenerationConfig``): vLLM stops where ktm's loop
        does (at ktm's end-of-sequence ids, unless the row ignores them) and nowhere else."""
        if cfg is None:
            return {"max_tokens": 1, "temperature": 0.0}
        out = {"max_tokens": cfg.max_new_tokens,
               "temperature": cfg.temperature if cfg.do_sample else 0.0,
               "top_p": cfg.top_p if cfg.do_sample else 1.0, "top_k": -1, "min_p": 0.0,
               "repetition_penalty": 1.0, "ignore_eos": True,
               "stop_token_ids": self.eos if cfg.stop_at_eos else []}
        if cfg.do_sample and cfg.seed is not None:
            out["seed"] = cfg.seed
        return out

    def _next(self, ids: list[str]) -> list[int | None]:
        """Each row's next token (None: vLLM has finished it), waiting for vLLM as needed."""
        want = [rid for rid in ids if not self._tokens[rid] and rid not in self._done]
        if want:
            self._pump(want)
        for rid in ids:
            if not self._tokens[rid] and rid in self._errors:
                raise KTMError(self._errors.pop(rid))
        return [self._tokens[rid].popleft() if self._tokens[rid] else None for rid in ids]

    def _drop(self, ids: list[str]) -> None:
        live = [rid for rid in ids if rid in self._tokens and rid not in self._done]
        if live:
            self._abort(live)
        for rid in ids:
            self._tokens.pop(rid, None)
            self._done.discard(rid)
            self._errors.pop(rid, None)

    def record(self) -> dict:
        """What a result row records of this runtime: its export and settings (no local paths)."""
        return {"engine": "vllm", "vllm": self.version, "transport": type(self).__name__,
                "served_model_name": self.manifest["served_model_name"],
                "export_sha256": self.manifest["sha256"],
                "lora_rows": self.manifest.get("lora_rows", LORA_ROWS["all"]),
                **{k: v for k, v in asdict(self.config).items() if k != "url"},
                "remote": self.config.url is not None}

    def keep_prefixes(self, max_bytes: int) -> None:
        """vLLM keeps its own prefix cache, within its KV cache."""

    def kv_bytes(self, state: VLLMState) -> int:
        """Bytes of keys and values (every layer) the batch's rows hold in vLLM's cache."""
        cells = sum(state.positions)
        c = self.lm_config
        heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return cells * c["num_hidden_layers"] * 2 * heads * head_dim * self.dtype.itemsize

    def clear(self) -> None:
        """Forget cached prefixes (a timed run prefills everything)."""

    # ---- what a transport implements ---------------------------------------------------------

    def _submit(self, rid: str, rows: torch.Tensor, cfg) -> None:
        raise NotImplementedError

    def _pump(self, want: list[str]) -> None:
        """Until every request in ``want`` has a token buffered or has finished."""
        raise NotImplementedError

    def _abort(self, ids: list[str]) -> None:
        raise NotImplementedError

    def score(self, prefixes, targets: list[list[int]]) -> list[torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: vLLM may be gone already
            pass


def default_len(lm_config: dict, config: VLLMConfig) -> int:
    if config.max_model_len is not None:
        return config.max_model_len
    return min(int(lm_config.get("max_position_embeddings") or 8192), 8192)


class VLLMEngine(VLLMRuntime):
    """A vLLM engine in this process: ``vllm.LLM``'s engine, stepped here, its engine core in
    this process too (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, unless the environment says
    otherwise): ktm steps the engine itself, and a core in a spawned process would re-run a
    script that has no ``if __name__ == "__main__":`` guard, which vLLM reports only as "Engine
    core initialization failed"."""

    def __init__(self, export_dir, config: VLLMConfig, eos_ids, pad_id: int):
        super().__init__(export_dir, config, eos_ids, pad_id)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU build warns per start
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{self.config.kv_cache_gb:g}"
        import vllm
        from vllm.sampling_params import RequestOutputKind

        self._vllm, self._delta = vllm, RequestOutputKind.DELTA
        self.llm = vllm.LLM(model=str(self.dir / LM_DIR), enable_prompt_embeds=True,
                            dtype=self.manifest["dtype"], enforce_eager=config.eager,
                            max_model_len=default_len(self.lm_config, config),
                            max_num_seqs=config.max_num_seqs, seed=0, disable_log_stats=True)
        self.engine = self.llm.llm_engine
        cache = self.engine.vllm_config.cache_config
        blocks = cache.num_gpu_blocks or cache.num_cpu_blocks
        self.context = None if not blocks else int(blocks * cache.block_size)

    def _submit(self, rid, rows, cfg) -> None:
        params = self._vllm.SamplingParams(**self._params(cfg), detokenize=False,
                                           output_kind=self._delta)
        try:
            self.engine.add_request(rid, {"prompt_embeds": rows}, params)
        except Exception as e:  # noqa: BLE001 - vLLM's validation errors, in one line
            raise KTMError(f"vLLM refused the request: {type(e).__name__}: {e}") from e

    def _step(self):
        try:
            return self.engine.step()
        except Exception as e:  # noqa: BLE001 - the engine process died or failed
            raise KTMError(f"the vLLM engine failed: {type(e).__name__}: {e}") from e

    def _pump(self, want) -> None:
        waiting = set(want)
        while waiting:
            if not self.engine.has_unfinished_requests():
                raise KTMError(f"vLLM has no request {sorted(waiting)[0]} running: it was "
                               "aborted or never added")
            for out in self._step():
                rid = out.request_id
                if rid not in self._tokens:
                    continue  # a request dropped while vLLM was still working on it
                self._tokens[rid].extend(out.outputs[0].token_ids)
                if out.finished:
                    self._done.add(rid)
                if self._tokens[rid] or out.finished:
                    waiting.discard(rid)

    def _abort(self, ids) -> None:
        self.engine.abort_request(ids)

    def clear(self) -> None:
        self.llm.reset_prefix_cache()

    def score(self, prefixes, targets):
        """Per prompt, the (T,) log-probabilities of its target tokens: the prefix as embeddings
        and the target as token ids in one prompt (vLLM's mixed prompts), read with
        ``prompt_logprobs``."""
        embed_rows = [self._rows(cp) for cp in prefixes]
        ids, out = [], {}
        for rows, target in zip(embed_rows, targets):
            rid = f"ktm-{next(self._ids)}"
            n = rows.shape[0]
            table = torch.zeros(len(target), self.width, dtype=rows.dtype)  # read as ids
            prompt = {"prompt_embeds": torch.cat([rows, table]),
                      "prompt_token_ids": [self.pad] * n + list(target),
                      "prompt_is_token_ids": [False] * n + [True] * len(target)}
            params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                               detokenize=False)
            try:
                self.engine.add_request(rid, prompt, params)
            except Exception as e:  # noqa: BLE001
                self._abort(ids)
                raise KTMError(f"vLLM refused the request: {type(e).__name__}: {e}") from e
            ids.append((rid, n, target))
        pending = {rid for rid, _, _ in ids}
        while pending:
            for o in self._step():
                if o.request_id in pending and o.finished:
                    out[o.request_id] = o.prompt_logprobs
                    pending.discard(o.request_id)
        return [torch.tensor([out[rid][n + i][t].logprob for i, t in enumerate(target)])
                for rid, n, target in ids]

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            self.engine = None
            engine.engine_core.shutdown()


def encode_embeds(embeds: torch.Tensor) -> str:
    """(L, D) tensor -> base64 of its ``torch.save`` bytes (vLLM's ``prompt_embeds``)."""
    buf = io.BytesIO()
    torch.save(embeds.detach().cpu().clone(), buf)  # clone: save this tensor, not a whole storage
    return base64.b64encode(buf.getvalue()).decode("ascii")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer(VLLMRuntime):
    """An OpenAI-compatible vLLM server: ``config.url``, or one started here (and stopped by
    ``close``). Each request streams its token ids on a thread of its own; a server that dies or
    stalls mid-request is an error after ``config.timeout`` seconds at most, never a hang."""

    def __init__(self, export_dir, config: VLLMConfig, eos_ids, pad_id: int):
        super().__init__(export_dir, config, eos_ids, pad_id)
        self.proc: subprocess.Popen | None = None
        self._cond = threading.Condition()
        self._streams: dict[str, object] = {}
        self.url = (config.url or "").rstrip("/")
        if config.url is None:
            self._start()
        self._check_served()

    def _start(self) -> None:
        port = free_port()
        cmd = server_command(str(self.dir / LM_DIR), self.manifest["served_model_name"],
                             self.manifest["dtype"])
        cmd += ["--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", str(default_len(self.lm_config, self.config)),
                "--max-num-seqs", str(self.config.max_num_seqs), "--seed", "0"]
        if self.config.eager:
            cmd.append("--enforce-eager")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": f"{self.config.kv_cache_gb:g}"}
        self.log = self.dir.parent / f".{self.dir.name}.vllm-server.log"
        with open(self.log, "ab") as log:  # a log: appended, as metrics.jsonl
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + self.config.timeout
        while True:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-5:]
                raise KTMError(f"the vLLM server exited with code {self.proc.returncode} while "
                               f"starting: {' | '.join(tail)}")
            try:
                with urllib.request.urlopen(self.url + "/models", timeout=5):
                    return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.close()
                    raise KTMError(f"the vLLM server did not start within "
                                   f"{self.config.timeout:g} s (log: {self.log})") from None
                time.sleep(1)

    def _check_served(self) -> None:
        name = self.manifest["served_model_name"]
        try:
            with urllib.request.urlopen(self.url + "/models", timeout=30) as r:
                served = [c.get("id") for c in json.loads(r.read()).get("data", [])]
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise KTMError(f"no vLLM server answers at {self.url} ({e}); start one with: "
                           f"{' '.join(server_command('EXPORT/lm', name, 'float32'))}") from e
        if name not in served:
            raise KTMError(f"vLLM at {self.url} serves {served}, not this export's {name!r}: the "
                           "encoder would feed another LM")

    def _submit(self, rid, rows, cfg) -> None:
        body = {"model": self.manifest["served_model_name"], "prompt_embeds":
                encode_embeds(rows), "stream": True, "return_token_ids": True,
                "skip_special_tokens": False, **self._params(cfg)}
        req = urllib.request.Request(self.url + "/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            resp = urllib.request.urlopen(req, timeout=self.config.timeout)
        except urllib.error.HTTPError as e:
            raise KTMError(f"vLLM at {self.url} refused the request ({e.code}): "
                           f"{e.read().decode('utf-8', 'replace')[:300]}") from e
        except (urllib.error.URLError, OSError) as e:
            raise KTMError(f"vLLM at {self.url} did not take the request: {e}") from e
        self._streams[rid] = resp
        threading.Thread(target=self._read, args=(rid, resp), daemon=True,
                         name=f"ktm-vllm-{rid}").start()

    def _read(self, rid: str, resp) -> None:
        """One request's stream: its token ids into the buffer, its end or failure noted."""
        error = f"the vLLM server at {self.url} stopped answering mid-request"
        try:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    error = None
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = f"vLLM failed the request: {chunk['error']}"
                    break
                ids = [t for c in chunk.get("choices", []) for t in c.get("token_ids") or []]
                with self._cond:
                    if rid in self._tokens:
                        self._tokens[rid].extend(ids)
                    self._cond.notify_all()
        except Exception as e:  # noqa: BLE001 - a dropped connection, a timeout
            error = f"{error}: {e}"
        finally:
            resp.close()
            with self._cond:
                if rid in self._tokens:
                    self._done.add(rid)
                    if error:
                        self._errors[rid] = error
                self._cond.notify_all()

    def _pump(self, want) -> None:
        deadline = time.monotonic() + self.config.timeout
        with self._cond:
            while True:
                if all(self._tokens[rid] or rid in self._done for rid in want):
                    return
                if self.proc is not None and self.proc.poll() is not None:
                    raise KTMError(f"the vLLM server exited (code {self.proc.returncode}) "
                                   "mid-request")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KTMError(f"vLLM at {self.url} sent no token for "
                                   f"{self.config.timeout:g} s")
                self._cond.wait(min(left, 1.0))

    def _abort(self, ids) -> None:
        for rid in ids:  # vLLM aborts a request whose client goes away
            resp = self._streams.pop(rid, None)
            if resp is not None:
                try:
                    resp.close()
                except Exception:  # noqa: BLE001, S110 - the reader thread may be closing it
                    pass
        with self._cond:
            for rid in ids:
                self._errors.pop(rid, None)

    def _drop(self, ids) -> None:
        super()._drop(ids)
        for rid in ids:
            self._streams.pop(rid, None)

    def score(self, prefixes, targets):
        raise KTMError("scoring (ktm eval, R, likelihoods) on vLLM needs the in-process engine: "
                       "a vLLM server's completions take prompt_embeds without token ids, so it "
                       "gives no log-probabilities of target tokens after them")

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.proc = None
