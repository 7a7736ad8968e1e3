"""Saving and loading a KTMModel: JSON config + encoder safetensors + PEFT adapter. No pickle.

    DIR/ktm_config.json        base model, K, encoder/LoRA settings, sizes, versions
    DIR/encoder.safetensors    encoder weights
    DIR/adapter/               PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ktm.encoder import EncoderConfig, KTokenEncoder
from ktm.errors import KTMError
from ktm.fileio import replace_dir, write_json_atomic
from ktm.models import load_base
from ktm.provenance import versions

CONFIG = "ktm_config.json"
ENCODER = "encoder.safetensors"
ADAPTER = "adapter"
FORMAT_VERSION = 1


def write_model_files(model, directory: Path) -> None:
    """Write the model's checkpoint files into an existing folder (not atomic by itself)."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.encoder.state_dict().items()}
    save_file(state, str(directory / ENCODER), metadata={"k": str(model.k)})
    model.peft.save_pretrained(str(directory / ADAPTER), safe_serialization=True)
    cfg = {"format": "ktm", "format_version": FORMAT_VERSION, **model.config_dict,
           "versions": versions()}
    write_json_atomic(directory / CONFIG, cfg)


def save_atomic(directory: str | Path, write) -> None:
    """Call ``write(tmp)`` on a temp folder beside ``directory``, then swap it in."""
    dest = Path(directory)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        write(tmp)
        replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_model(model, directory: str | Path) -> None:
    """Write a checkpoint; a crash midway leaves any previous checkpoint intact."""
    save_atomic(directory, lambda tmp: write_model_files(model, tmp))


def check_compatible(model, directory: str | Path) -> dict:
    """Refuse a checkpoint whose K, encoder or sizes differ from ``model``'s."""
    cfg = read_config(directory)
    mine = model.config_dict
    for key in ("hidden_size", "vocab_size"):
        if cfg.get(key) != mine[key]:
            raise KTMError(f"checkpoint {str(directory)!r} has {key}={cfg.get(key)}, "
                           f"but the model has {key}={mine[key]}")
    saved = cfg.get("encoder")
    if isinstance(saved, dict):  # fields added later default to off in older checkpoints
        saved = EncoderConfig.from_dict(saved).to_dict()
    if saved != mine["encoder"]:
        raise KTMError(f"checkpoint {str(directory)!r} has encoder {cfg.get('encoder')} "
                       f"(K={cfg.get('encoder', {}).get('k')}), but the model has "
                       f"{mine['encoder']} (K={model.k})")
    return cfg


def load_weights_into(model, directory: str | Path) -> None:
    """Load a checkpoint's encoder and LoRA weights into an existing, compatible model."""
    directory = Path(directory)
    check_compatible(model, directory)
    encoder = _load_encoder(directory, model.encoder.config)
    model.encoder.load_state_dict(encoder.state_dict())
    load_adapter_into(model, directory)


def load_adapter_into(model, directory: str | Path) -> None:
    """Load only a checkpoint's LoRA weights (any K: the K curriculum starts K=4 from the K=2
    reader's adapter); the LoRA settings and the model's sizes must match. A recursive encoder
    whose inner level has the checkpoint's encoder config also gets that encoder's weights."""
    directory = Path(directory)
    cfg = read_config(directory)
    inner = getattr(model.encoder, "inner", None)
    if inner is not None and isinstance(cfg.get("encoder"), dict):
        saved = EncoderConfig.from_dict(cfg["encoder"])
        if saved == inner.config:
            inner.load_state_dict(_load_encoder(directory, saved).state_dict())
    mine = model.config_dict
    for key in ("hidden_size", "vocab_size"):
        if cfg.get(key) != mine[key]:
            raise KTMError(f"checkpoint {str(directory)!r} has {key}={cfg.get(key)}, "
                           f"but the model has {key}={mine[key]}")
    saved = {k: v for k, v in (cfg.get("lora") or {}).items() if k in ("r", "alpha")}
    wanted = {k: mine["lora"][k] for k in ("r", "alpha")}
    if saved != wanted:
        raise KTMError(f"checkpoint {str(directory)!r} has LoRA {saved}, but the model has "
                       f"{wanted}: expected the same LoRA settings")
    path = directory / ADAPTER / "adapter_model.safetensors"
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise KTMError(f"LoRA adapter {str(path)!r} is missing or corrupt: {e}") from e
    result = set_peft_model_state_dict(model.peft, state)
    if result.unexpected_keys:
        raise KTMError(f"LoRA adapter {str(path)!r} has unexpected weights "
                       f"{result.unexpected_keys[:3]}: it was trained with other LoRA settings")


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise KTMError(f"{str(directory)!r} is not a ktm checkpoint: {CONFIG} is missing")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KTMError(f"checkpoint config {str(path)!r} is corrupt: {e}") from e
    if not isinstance(cfg, dict) or cfg.get("format") != "ktm":
        raise KTMError(f"{str(path)!r} is not a ktm checkpoint config")
    if cfg.get("format_version") != FORMAT_VERSION:
        raise KTMError(f"checkpoint format_version {cfg.get('format_version')!r} is not supported; "
                       f"expected {FORMAT_VERSION}")
    return cfg


def _load_encoder(directory: Path, enc_cfg: EncoderConfig) -> KTokenEncoder:
    path = directory / ENCODER
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise KTMError(f"encoder file {str(path)!r} is missing or corrupt: {e}") from e
    encoder = KTokenEncoder.from_config(enc_cfg)
    expected = {k: tuple(v.shape) for k, v in encoder.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    if expected != found:
        raise KTMError(
            f"encoder weights in {str(path)!r} do not fit K={enc_cfg.k}, "
            f"hidden_size={enc_cfg.hidden_size}: expected shapes {expected}, found {found}"
        )
    encoder.load_state_dict(state)
    return encoder


def load_model(directory, *, base=None, k=None, device="cpu", dtype=torch.float32,
               trainable=False):
    """Load a checkpoint; refuse one whose K or sizes disagree with what the caller expects."""
    from ktm.model import KTMModel, LoraSettings
    from ktm.readers import resolve_checkpoint

    directory = resolve_checkpoint(directory)
    cfg = read_config(directory)
    try:
        enc_cfg = EncoderConfig.from_dict(cfg["encoder"])
        lora = LoraSettings(**cfg["lora"])
        base_name = base or cfg["base_model"]
    except (KeyError, TypeError) as e:
        raise KTMError(f"checkpoint config in {str(directory)!r} is incomplete: {e}") from e
    if k is not None and k != enc_cfg.k:
        raise KTMError(f"checkpoint {str(directory)!r} was trained with K={enc_cfg.k}, "
                       f"but K={k} was requested")
    lm, tok = load_base(base_name, device, dtype)
    hidden, vocab = lm.config.hidden_size, lm.get_input_embeddings().weight.shape[0]
    if (hidden, vocab) != (cfg.get("hidden_size"), cfg.get("vocab_size")):
        raise KTMError(
            f"checkpoint expects hidden_size={cfg.get('hidden_size')}, "
            f"vocab_size={cfg.get('vocab_size')}, but base model {base_name!r} has "
            f"hidden_size={hidden}, vocab_size={vocab}"
        )
    encoder = _load_encoder(directory, enc_cfg).to(device, dtype)
    try:
        peft_model = PeftModel.from_pretrained(lm, str(directory / ADAPTER), is_trainable=trainable)
    except (OSError, ValueError, SafetensorError, RuntimeError) as e:
        raise KTMError(f"LoRA adapter in {str(directory / ADAPTER)!r} is missing or corrupt: {e}"
                       ) from e
    encoder.requires_grad_(trainable)
    model = KTMModel(peft_model, tok, encoder, base_name, lora, cfg.get("add_eos", True),
                     cfg.get("plain_prefix", 0))
    return model.train(trainable) if trainable else model.eval()
