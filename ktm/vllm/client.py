"""A small client for a ktm model served by vLLM: merged prefixes are computed here and sent as
``prompt_embeds``.

    ktm export --format vllm out/x --model runs/x/checkpoint
    python -m vllm.entrypoints.openai.api_server --model out/x/lm \
        --served-model-name <name from the export> --enable-prompt-embeds

    client = VLLMClient("out/x", "http://127.0.0.1:8000/v1")
    client.complete([Segment(document), Segment("\\nQuestion: ...? Answer:", compress=False)])

The client needs only the export's tokenizer, the LM's input-embedding table and the encoder
(``ktm.core.prefix.encode_prompts``, the same step the ktm model runs), never the LM itself; an
encoder that reads the base LM's first L layers (``context_layers``) runs them here, from the
export's copy of those layers.

Payload, as vLLM documents it for its Completions API: ``prompt_embeds`` is a (L, D) tensor
written with ``torch.save`` and base64-encoded (vLLM reads it back with
``torch.load(weights_only=True)``); ``prompt`` is left out. The request's ``model`` is the
export's served name, which carries a fingerprint of the exported LM and encoder files: before
the first request the client asks the server's ``/models`` and refuses one that does not serve
this export (another base model, or the same base with another encoder or adapter).
"""

from __future__ import annotations

import base64
import io
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoTokenizer

from ktm.core.base_model import parse_dtype
from ktm.core.batch import CompressedPrompt
from ktm.core.encoder import EncoderConfig, KTokenEncoder
from ktm.core.prefix import PromptEncoder
from ktm.core.prompt import PromptLike, as_segments
from ktm.core.tokens import SegmentTokenizer, line_break_ids
from ktm.errors import KTMError
from ktm.util.fileio import sha256_files
from ktm.vllm.export import (
    ENCODER,
    LM_DIR,
    lm_files,
    read_manifest,
    tokenizer_files,
)
from ktm.vllm.install import server_command

# vLLM fills a sampling option the request leaves out from the LM's generation_config.json
# (its default ``--generation-config auto``: e.g. Qwen2.5's top_k 20, repetition_penalty 1.05);
# ktm samples with temperature and top_p only, so the others are sent at their neutral values
# (top_k -1: every vLLM version reads it as "off")
NEUTRAL_SAMPLING = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def encode_embeds(embeds: torch.Tensor) -> str:
    """(L, D) tensor -> base64 of its ``torch.save`` bytes (vLLM's ``prompt_embeds``)."""
    buf = io.BytesIO()
    torch.save(embeds.detach().cpu().clone(), buf)  # clone: save this tensor, not a whole storage
    return base64.b64encode(buf.getvalue()).decode("ascii")


class VLLMClient:
    def __init__(self, export_dir: str | Path, base_url: str = "http://127.0.0.1:8000/v1",
                 timeout: float = 600.0, verify_files: bool = True):
        self.dir = Path(export_dir)
        self.manifest = m = read_manifest(self.dir)
        self.base_url, self.timeout = base_url.rstrip("/"), timeout
        self.model_name: str = m["served_model_name"]
        if verify_files:
            self._verify_files()
        lm_dir = self.dir / LM_DIR
        lm_cfg = AutoConfig.from_pretrained(lm_dir)
        # the encoder is as wide as the input embeddings, which the LM may project up to its
        # hidden size (OPT-350m); an export without the field has them equal
        self.width: int = m.get("embedding_size", m["hidden_size"])
        if (lm_cfg.hidden_size, m["encoder"]["hidden_size"]) != (m["hidden_size"], self.width):
            raise KTMError(f"the LM in {str(lm_dir)!r} has hidden_size {lm_cfg.hidden_size} and "
                           f"the encoder {m['encoder']['hidden_size']}, but the export was made "
                           f"for hidden_size {m['hidden_size']} and input embeddings "
                           f"{self.width} wide: the LM and the encoder do not belong together")
        self.tokenizer = AutoTokenizer.from_pretrained(lm_dir)
        self.tokenize = SegmentTokenizer(self.tokenizer)  # as KTMModel.tokenize
        dtype = parse_dtype(m["dtype"])
        self.embed = nn.Embedding.from_pretrained(self._embedding_table().to(dtype))
        self.encoder = KTokenEncoder.from_config(EncoderConfig.from_dict(m["encoder"]))
        self.encoder.load_state_dict(load_file(str(self.dir / ENCODER)))
        if self.encoder.config.context_layers:
            self.encoder.bind_lm(self._context_states(dtype))
        self.encoder.eval()  # fp32 weights, as in the model (bf16 runs under autocast)
        pad = self.tokenizer.pad_token_id
        self.prompt_encoder = PromptEncoder(self.tokenize, self.embed, self.encoder,
                                            pad if pad is not None else 0, m["plain_prefix"],
                                            plain_suffix=m.get("plain_suffix", 0),
                                            line_breaks=line_break_ids(self.tokenizer)
                                            if m.get("align_lines") else None)
        self.server_checked = False

    # ---------------------------------------------------------------- the files
    def _verify_files(self) -> None:
        """The LM, tokenizer and encoder beside the manifest are the ones it was written with
        (an export from before the tokenizer's sha256 checks the other two)."""
        want = self.manifest["sha256"]
        got = {"lm": sha256_files(lm_files(self.dir / LM_DIR)),
               "encoder": sha256_files([self.dir / ENCODER]),
               "tokenizer": sha256_files(tokenizer_files(self.dir / LM_DIR))}
        for part in ("lm", "encoder", "tokenizer"):
            if part in want and got[part] != want[part]:
                raise KTMError(f"the {part} files in {str(self.dir)!r} are not the ones this "
                               f"export was made with (sha256 {got[part][:12]} != "
                               f"{want[part][:12]}): base model / encoder mismatch; re-export")

    def _context_states(self, dtype: torch.dtype):
        """The base LM's first L layers, which a ``context_layers`` encoder reads."""
        from transformers import AutoModelForCausalLM

        from ktm.core.context_states import LayerStates

        c = self.manifest.get("context_lm")
        layers = self.encoder.config.context_layers
        if not isinstance(c, dict) or c.get("layers") != layers:
            raise KTMError(f"{str(self.dir)!r} is corrupt: its encoder reads the LM's first "
                           f"{layers} layers, but the manifest's context_lm is {c!r}; re-export")
        folder = self.dir / c["dir"]
        if sha256_files(lm_files(folder)) != c["sha256"]:
            raise KTMError(f"the files in {str(folder)!r} are not the ones this export was made "
                           "with: re-export")
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        return LayerStates(lm, layers, int(c["sink_id"]))

    def _embedding_table(self) -> torch.Tensor:
        e = self.manifest["embeddings"]
        try:
            with safe_open(str(self.dir / e["file"]), framework="pt") as f:
                table = f.get_tensor(e["key"])
        except (SafetensorError, OSError, KeyError) as err:
            raise KTMError(f"input embeddings {e['key']!r} not found in "
                           f"{str(self.dir / e['file'])!r}: {err}") from err
        if tuple(table.shape) != (self.manifest["vocab_size"], self.width):
            raise KTMError(f"input embeddings have shape {tuple(table.shape)}, expected "
                           f"({self.manifest['vocab_size']}, {self.width})")
        return table

    # ---------------------------------------------------------------- prompts
    @torch.no_grad()
    def encode(self, prompt: PromptLike, merge: bool = True) -> CompressedPrompt:
        """The prompt's LM input embeddings, merged exactly as the ktm model merges them."""
        return self.prompt_encoder.encode([as_segments(prompt)],
                                          merge and self.manifest["merges"])[0]

    def payload(self, prompt: PromptLike, max_tokens: int = 16, temperature: float = 0.0,
                top_p: float = 1.0, stop: list[str] | None = None, seed: int | None = None,
                merge: bool = True) -> dict:
        """The JSON body of a vLLM ``/completions`` request for ``prompt``."""
        cp = self.encode(prompt, merge)
        body = {"model": self.model_name, "prompt_embeds": encode_embeds(cp.embeds),
                "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                **NEUTRAL_SAMPLING}
        if stop:
            body["stop"] = list(stop)
        if seed is not None:
            body["seed"] = seed
        return body

    # ---------------------------------------------------------------- the server
    def _call(self, path: str, body: dict | None = None) -> dict:
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", "replace")[:1000]  # bytes cut mid-character failed
            raise KTMError(f"vLLM at {url} answered {e.code}: {text}") from e
        except urllib.error.URLError as e:
            raise KTMError(f"no vLLM server at {url} ({e.reason}); start one with: "
                           f"{self.serve_command()}") from e
        except TimeoutError as e:  # a read timeout is not wrapped in URLError
            raise KTMError(f"vLLM at {url} did not answer within {self.timeout:g} s "
                           "(VLLMClient timeout=)") from e
        try:
            answer = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            answer = None
        if not isinstance(answer, dict):  # a proxy's HTML page, a truncated body
            raise KTMError(f"vLLM at {url} answered {raw[:200]!r}: expected a JSON object "
                           "(is base_url the server's /v1?)")
        return answer

    def serve_command(self) -> str:
        """The command that serves this export (with vLLM's CPU or CUDA wheel alike)."""
        return " ".join(server_command(str(self.dir / LM_DIR), self.model_name,
                                       self.manifest["dtype"])).replace(sys.executable, "python")

    def check_server(self) -> dict:
        """Refuse a server that does not serve this export's LM; returns its model card."""
        served = self._call("/models").get("data", [])
        for card in served:
            if card.get("id") == self.model_name:
                self.server_checked = True
                return card
        raise KTMError(f"vLLM at {self.base_url} serves {[c.get('id') for c in served]}, not "
                       f"this export's {self.model_name!r} (K={self.manifest['k']}, base "
                       f"{self.manifest['base_model']!r}): the encoder would feed another LM. "
                       f"Serve this export with: {self.serve_command()}")

    def complete(self, prompt: PromptLike, **kwargs) -> str:
        """Text of one completion (``payload`` options: max_tokens, temperature, ...)."""
        if not self.server_checked:
            self.check_server()
        out = self._call("/completions", self.payload(prompt, **kwargs))
        try:
            return out["choices"][0]["text"]
        except (KeyError, IndexError, TypeError) as e:
            raise KTMError(f"vLLM answered {json.dumps(out)[:300]}: expected a completion "
                           "(choices[0].text)") from e
