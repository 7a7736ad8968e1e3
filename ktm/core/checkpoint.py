"""A ktm checkpoint's files: JSON config + encoder safetensors + PEFT adapter. No pickle.

    DIR/ktm_config.json        KTMConfig, sizes, base model identity (ktm.core.base_identity),
                               which modules got LoRA, package versions
    DIR/encoder.safetensors    encoder weights (fp32)
    DIR/adapter/               PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)
    DIR/compressor.json        a baseline's method and options, when trained with one (written
                               by ``ktm.compressors.record``, not here: the core never imports a
                               baseline), with the method's fitted state (LTSC)

A leaf module (PEFT's ``save_pretrained``/``from_pretrained`` split): it reads and writes files
for any object with the model's attributes and never imports the model; ``KTMModel.load`` builds
the model from what it returns. ``ktm_config.json`` format 2 keeps the ``KTMConfig`` under
``config``; format 1 (before ``KTMConfig``) is still read.
"""

from __future__ import annotations

import copy
import json
import shutil
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftConfig, PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ktm.core.base_identity import base_identity, check_same_base
from ktm.core.config import KTMConfig
from ktm.core.encoder import EncoderConfig, KTokenEncoder
from ktm.core.lora import adapted_modules, peft_wrapping
from ktm.errors import KTMError
from ktm.util.fileio import (
    WriteError,
    replace_dir,
    temp_dir_beside,
    write_error,
    write_json_atomic,
)
from ktm.util.provenance import versions

CONFIG = "ktm_config.json"
ENCODER = "encoder.safetensors"
ADAPTER = "adapter"
ADAPTER_WEIGHTS = f"{ADAPTER}/adapter_model.safetensors"
SURPRISAL = "surprisal.safetensors"  # a reader's n-gram table (ktm.core.surprisal), if any
FORMAT_VERSION = 2
COMPRESSOR_RECORD = "compressor.json"
# baselines that are only an encoder setting (the loaded model already is them), the rest
# rewrite prompts; kept equal to ``ktm.compressors`` by a test, as the core never imports it
SETTING_ONLY = ("mean_pool",)
READABLE_FORMATS = (1, 2)
# errors that mean "this file is missing, truncated or not what it claims to be"
FILE_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError, KeyError, TypeError)


# the base identity of each model, hashed once (its tokenizer's vocabulary: about 0.1 s)
_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def base_identity_of(model) -> dict:
    """``model``'s base model identity (``ktm.core.base_identity``), hashed on first use."""
    if model not in _IDENTITIES:
        _IDENTITIES[model] = base_identity(model.lm_config, model.tokenizer)
    return _IDENTITIES[model]


# ---------------------------------------------------------------- writing
def model_record(model) -> dict:
    """What a checkpoint's config file holds of ``model`` (also what result rows record): its
    KTMConfig, sizes, LoRA'd modules and its base model's identity (``ktm.core.base_identity``)."""
    lm_config = model.lm_config
    return {
        "config": model.config.to_dict(),
        "hidden_size": lm_config.hidden_size,
        "vocab_size": model.input_embedding.weight.shape[0],
        "model_type": lm_config.model_type,
        "lora_modules": adapted_modules(model.peft),
        "base_identity": base_identity_of(model),
    }


def digest_weights(model, h) -> None:
    """Feed ``model``'s encoder and LoRA weights to the hash ``h`` (an export's cache key). A
    LoRA whose B are all zero (a base model's, as ``load_any`` opens one) adds nothing to any
    row, so only that is fed: its A, drawn at random, would make each process's export new."""
    lora = [(n, p) for n, p in model.peft.named_parameters() if "lora_" in n]
    if not any(bool(p.detach().any()) for n, p in lora if "lora_B" in n):
        lora = []
        h.update(b"no LoRA")
    for _, p in sorted(list(model.encoder.state_dict().items()) + lora):
        h.update(p.detach().float().cpu().numpy().tobytes())


def write_model_files(model, directory: Path) -> None:
    """Write the model's checkpoint files into an existing folder (not atomic by itself)."""
    state = {k: v.detach().float().contiguous().cpu()
             for k, v in model.encoder.state_dict().items()}
    save_file(state, str(directory / ENCODER), metadata={"k": str(model.k)})
    model.peft.save_pretrained(str(directory / ADAPTER), safe_serialization=True)
    if model.scorer.table is not None:  # the reader's own surprisal table (ktm.core.surprisal)
        model.scorer.table.save(directory / SURPRISAL)
    record_base_by_name(directory / ADAPTER / "adapter_config.json", model.config.base_model)
    write_json_atomic(directory / CONFIG, {"format": "ktm", "format_version": FORMAT_VERSION,
                                           **model_record(model), "versions": versions()})


def save_atomic(directory: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temp folder beside ``directory``, then swap it in. A failed
    write (no space, no permission) is a ``KTMError`` naming ``directory``, which is intact."""
    dest = Path(directory)
    tmp = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_dir_beside(dest)
        write(tmp)
        replace_dir(tmp, dest)
    except (OSError, SafetensorError, WriteError) as e:
        raise write_error(dest, e) from e
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def save_model(model, directory: str | Path) -> None:
    """Write a checkpoint; a crash midway leaves any previous checkpoint intact. Only a
    checkpoint or an empty folder is replaced: the swap would delete anything else there."""
    dest = Path(directory)
    if dest.exists() and not (dest.is_dir() and (not any(dest.iterdir())
                                                 or (dest / CONFIG).is_file())):
        raise KTMError(f"{str(dest)!r} exists and is not a ktm checkpoint (saving would replace "
                       "it and everything in it): expected a new or empty folder, or a checkpoint")
    save_atomic(directory, lambda tmp: write_model_files(model, tmp))


# ---------------------------------------------------------------- reading
def read_config(directory: str | Path) -> dict:
    """The checkpoint's ``ktm_config.json`` as written (format checked)."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise KTMError(f"{str(directory)!r} is not a ktm checkpoint: {CONFIG} is missing")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KTMError(f"checkpoint config {str(path)!r} is corrupt: {e}") from e
    if not isinstance(cfg, dict) or cfg.get("format") != "ktm":
        raise KTMError(f"{str(path)!r} is not a ktm checkpoint config")
    if cfg.get("format_version") not in READABLE_FORMATS:
        raise KTMError(f"checkpoint format_version {cfg.get('format_version')!r} is not supported; "
                       f"expected one of {READABLE_FORMATS}")
    return cfg


def read_compressor_record(directory: str | Path) -> dict | None:
    """``{"name", "options"}`` of the baseline the checkpoint was trained with, as written (the
    name is checked against the registry by ``ktm.compressors.record``); None without one."""
    path = Path(directory) / COMPRESSOR_RECORD
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KTMError(f"compressor record {str(path)!r} is unreadable: {e}") from e
    if (not isinstance(rec, dict) or not isinstance(rec.get("name"), str)
            or not isinstance(rec.get("options"), dict)):
        raise KTMError(f"compressor record {str(path)!r} is corrupt: expected "
                       f"{{'name': a method, 'options': {{...}}}}, got {rec!r}")
    return rec


def model_config(directory: str | Path, saved: dict | None = None) -> KTMConfig:
    """The ``KTMConfig`` a checkpoint was saved with (``saved``: its ``ktm_config.json``,
    already read)."""
    try:
        return KTMConfig.from_checkpoint(read_config(directory) if saved is None else saved)
    except KTMError as e:
        raise KTMError(f"checkpoint {str(directory)!r}: {e}") from e


def read_surprisal(directory: str | Path):
    """The checkpoint's surprisal table (``ktm.core.surprisal``), or None if it has none."""
    from ktm.core.surprisal import SurprisalTable

    path = Path(directory) / SURPRISAL
    return SurprisalTable.load(path) if path.is_file() else None


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder's records, each file read once (``Checkpoint.open``): what
    ``KTMModel.load`` and the commands take instead of the folder, so nothing parses
    ``ktm_config.json`` or ``compressor.json`` again. The weights stay on disk until asked for
    (``encoder_state``, ``load_peft``): a command that only checks flags against the config
    reads no tensor."""

    path: Path
    name: str  # what it was opened by (a reader's name, a folder as given): for messages
    saved: dict  # ktm_config.json as written (sizes, base identity, versions, config)
    config: KTMConfig  # the KTMConfig it was saved with
    compressor: dict | None  # compressor.json: a baseline's method and options, if any
    surprisal: object | None  # its n-gram table (``ktm.core.surprisal``), if any
    adapter: PeftConfig  # adapter/adapter_config.json, as PEFT reads it

    def __fspath__(self) -> str:  # where a path is asked for, the folder
        return str(self.path)

    @property
    def adapter_targets(self) -> tuple[str, ...] | None:
        """The module names the saved adapter covers (the truth for any format)."""
        targets = self.adapter.target_modules
        return tuple(sorted(targets)) if isinstance(targets, (list, set, tuple)) else None

    @classmethod
    def open(cls, directory: str | Path, name: str | None = None) -> Checkpoint:
        """Read a checkpoint folder's records (``ktm.readers.open_checkpoint`` also takes a
        shipped reader's name); ``name``: what the user called it (None: the folder)."""
        name = str(directory) if name is None else name
        directory = Path(directory)
        saved = read_config(directory)
        return cls(directory, name, saved, model_config(directory, saved),
                   read_compressor_record(directory), read_surprisal(directory),
                   read_adapter_config(directory))

    def check_level(self, k: int | None) -> None:
        check_level(self.config, k, self.path)

    def encoder_state(self, enc_cfg: EncoderConfig) -> dict[str, torch.Tensor]:
        return encoder_state(self.path, enc_cfg)

    def load_peft(self, lm, trainable: bool) -> PeftModel:
        # a copy: PEFT sets the config's inference mode, and this record is read again
        return load_peft(lm, self.path, trainable, copy.deepcopy(self.adapter))


def as_checkpoint(checkpoint: str | Path | Checkpoint) -> Checkpoint:
    """``checkpoint`` opened, unless it already is (a folder; names: ``ktm.readers``)."""
    return checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint.open(checkpoint)


def check_level(config: KTMConfig, k: int | None, directory: str | Path) -> None:
    """Refuse a K the checkpoint cannot merge at: its own, or a recursive one's inner K."""
    if k is not None and k not in config.levels:
        inner = config.levels[1:]
        inner = f" (or its inner K={'/'.join(map(str, inner))})" if inner else ""
        raise KTMError(f"checkpoint {str(directory)!r} was trained with K={config.k}{inner}, "
                       f"but K={k} was requested")


def check_sizes(model, directory: str | Path, saved: dict) -> None:
    mine = model_record(model)
    for key in ("hidden_size", "vocab_size"):
        if saved.get(key) != mine[key]:
            # most often the model was built on another base (--init-adapter without --model
            # builds the default one): name both
            theirs = (saved.get("config") or saved).get("base_model")
            raise KTMError(f"checkpoint {str(directory)!r} has {key}={saved.get(key)} (base "
                           f"model {theirs!r}), but the model has {key}={mine[key]} (base model "
                           f"{model.config.base_model!r}): expected the checkpoint's base model "
                           "(--model)")
    check_same_base(directory, saved, model.config.base_model, lambda: base_identity_of(model))


def config_differences(saved: KTMConfig, mine: KTMConfig) -> list[tuple[str, object, object]]:
    """(name, saved, mine) for every field that changes the model (not base path or dtype)."""
    out = [("K" if name == "k" else name, getattr(saved, name), getattr(mine, name))
           for name in (*KTMConfig.ENCODER_FIELDS, "plain_prefix", "plain_suffix",
                        "align_lines", "spread_positions", "add_eos")]
    out += [(f"lora.{name}", getattr(saved.lora, name), getattr(mine.lora, name))
            for name in ("r", "alpha", "dropout")]
    return [d for d in out if d[1] != d[2]]


def check_compatible(model, directory: str | Path | Checkpoint) -> dict:
    """Refuse a checkpoint whose K, encoder, LoRA settings or sizes differ from ``model``'s."""
    ckpt = as_checkpoint(directory)
    directory, saved = ckpt.path, ckpt.saved
    check_sizes(model, directory, saved)
    diffs = config_differences(ckpt.config, model.config)
    targets = ckpt.adapter_targets
    mine = tuple(sorted(model.config.lora.target_modules or ()))
    if targets is not None and targets != mine:
        diffs.append(("lora.target_modules", list(targets), list(mine)))
    if diffs:
        theirs = ", ".join(f"{n}={a!r}" for n, a, _ in diffs)
        ours = ", ".join(f"{n}={b!r}" for n, _, b in diffs)
        raise KTMError(f"checkpoint {str(directory)!r} was saved with {theirs}, but this run has "
                       f"{ours}: expected the same model settings")
    return saved


def encoder_state(directory: str | Path, enc_cfg: EncoderConfig) -> dict[str, torch.Tensor]:
    """The saved encoder weights, checked against the shapes ``enc_cfg`` gives."""
    path = Path(directory) / ENCODER
    try:
        state = load_file(str(path))
    except FILE_ERRORS as e:
        raise KTMError(f"encoder file {str(path)!r} is missing or corrupt: {e}") from e
    with torch.device("meta"):  # shapes only: no memory, and no draw from the caller's RNG
        expected = {k: tuple(v.shape) for k, v in KTokenEncoder.from_config(enc_cfg)
                    .state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    if expected != found:
        raise KTMError(
            f"encoder weights in {str(path)!r} do not fit K={enc_cfg.k}, "
            f"hidden_size={enc_cfg.hidden_size}: expected shapes {expected}, found {found}")
    return state


def load_adapter_into(model, directory: str | Path | Checkpoint) -> None:
    """Load only a checkpoint's LoRA weights (any K: the K curriculum starts K=4 from the K=2
    reader's adapter); the model's sizes must match. A recursive encoder
    whose inner level has the checkpoint's encoder config also gets that encoder's weights.

    A model whose LoRA rank is larger than the checkpoint's *grows* it: see ``grow_lora``.
    """
    ckpt = as_checkpoint(directory)
    directory, saved = ckpt.path, ckpt.saved
    check_sizes(model, directory, saved)
    inner = getattr(model.encoder, "inner", None)
    if inner is not None:
        theirs = EncoderConfig(inner.config.hidden_size, **ckpt.config.encoder_kwargs())
        if theirs == inner.config:
            inner.load_state_dict(encoder_state(directory, theirs))
    theirs, mine = ckpt.config.lora, model.config.lora
    if theirs.r > mine.r:
        raise KTMError(f"checkpoint {str(directory)!r} has LoRA r={theirs.r}, but the model has "
                       f"r={mine.r}: expected a rank at least the checkpoint's (a larger one "
                       "grows the adapter; a smaller one cannot hold it)")
    path = directory / ADAPTER_WEIGHTS
    try:
        state = load_file(str(path))
    except FILE_ERRORS as e:
        raise KTMError(f"LoRA adapter {str(path)!r} is missing or corrupt: {e}") from e
    if (theirs.r, theirs.alpha) != (mine.r, mine.alpha):
        state = grow_lora(state, get_peft_model_state_dict(model.peft),
                          scale=(theirs.alpha / theirs.r) / (mine.alpha / mine.r))
    try:
        result = set_peft_model_state_dict(model.peft, state)
    except (RuntimeError, ValueError) as e:  # size mismatch: another base model
        raise KTMError(f"LoRA adapter {str(path)!r} does not fit this model (another base "
                       f"model?): {str(e).splitlines()[0]}") from e
    if result.unexpected_keys:
        # same sizes, other module names: most often another model family (gpt2 vs opt)
        kind, mine = saved.get("model_type"), model_record(model)["model_type"]
        why = (f"it was trained on a {kind!r} model, this one is {mine!r}" if kind and kind != mine
               else "it was trained with other LoRA settings")
        raise KTMError(f"LoRA adapter {str(path)!r} has unexpected weights "
                       f"{result.unexpected_keys[:3]}: {why}")


def grow_lora(saved: dict[str, torch.Tensor], current: dict[str, torch.Tensor],
              scale: float) -> dict[str, torch.Tensor]:
    """A rank-r adapter inside a rank-R >= r one (or another alpha), computing exactly the same
    function.

    LoRA adds ``(alpha/r) * B @ A``. The saved A fills the first r rows of the new A (the other
    rows keep their fresh init, so gradients reach the new columns of B); the saved B, times
    ``scale`` = (alpha/r)_saved / (alpha/R)_new, fills the first r columns of the new B, and the
    other columns are zero. Training then uses the extra rank from the saved adapter's function.
    """
    out = {}
    for key, value in saved.items():
        if key not in current or not (".lora_A." in key or ".lora_B." in key):
            out[key] = value  # unknown keys are reported by the caller
            continue
        new = current[key].detach().clone()
        value = value.to(new.dtype)
        r = value.shape[0] if ".lora_A." in key else value.shape[-1]
        if ".lora_A." in key and new.shape[1:] == value.shape[1:]:
            new[:r] = value
        elif ".lora_B." in key and new.shape[:-1] == value.shape[:-1]:
            new.zero_()
            new[..., :r] = value * scale
        else:
            raise KTMError(f"LoRA weight {key!r} has shape {tuple(value.shape)}, which does not "
                           f"fit this model's {tuple(new.shape)}: expected another rank only")
        out[key] = new
    return out


def load_weights_into(model, directory: str | Path | Checkpoint) -> None:
    """Load a checkpoint's encoder and LoRA weights into an existing, compatible model."""
    ckpt = as_checkpoint(directory)
    check_compatible(model, ckpt)
    model.encoder.load_state_dict(ckpt.encoder_state(model.encoder.config))
    load_adapter_into(model, ckpt)


def record_base_by_name(adapter_config: Path, base_model: str) -> None:
    """PEFT records the base as the path it was loaded from (a cache folder of this machine);
    a checkpoint records it by name instead (an embedded model's, else its folder's), its
    identity being ``ktm_config.json``'s ``base_identity``: no local path ships."""
    cfg = json.loads(adapter_config.read_text())
    cfg["base_model_name_or_path"] = Path(base_model).name
    write_json_atomic(adapter_config, cfg)


def read_adapter_config(directory: str | Path) -> PeftConfig:
    """The saved adapter's ``adapter_config.json`` as PEFT reads it (read here, and given to
    PEFT, which otherwise reads it twice)."""
    path = Path(directory) / ADAPTER
    if not (path / "adapter_config.json").is_file():  # PEFT would look for it on the Hub
        raise KTMError(f"LoRA adapter in {str(path)!r} is missing or corrupt: "
                       "adapter_config.json is missing")
    try:
        return PeftConfig.from_pretrained(str(path))
    except (*FILE_ERRORS, UnicodeDecodeError) as e:
        raise KTMError(f"LoRA adapter in {str(path)!r} is missing or corrupt: "
                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


def load_peft(lm, directory: str | Path, trainable: bool,
              config: PeftConfig | None = None) -> PeftModel:
    """The base LM with the checkpoint's LoRA adapter (trainable adapter weights stay fp32);
    ``config``: its adapter config already read (None: PEFT reads it)."""
    path = Path(directory) / ADAPTER
    try:
        with peft_wrapping():
            peft = PeftModel.from_pretrained(lm, str(path), is_trainable=trainable,
                                             config=config)
    except FILE_ERRORS as e:
        raise KTMError(f"LoRA adapter in {str(path)!r} is missing or corrupt, or does not fit the "
                       f"base model: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                       ) from e
    # the saved adapter names its base (``record_base_by_name``); PEFT reads the base's files
    # from the path it holds when it saves again, so it holds where the base is here
    for cfg in peft.peft_config.values():
        cfg.base_model_name_or_path = lm.name_or_path
    return peft


def check_exportable(model, engine: str) -> None:
    """Refuse a model another engine (``engine``: llama.cpp, vLLM) cannot read as ktm does: one
    fine-tuned on prompts a baseline rewrote (the engine would read them as given), one with
    LTSC's meta-token rows (ids the engine's LM lacks), one with spread positions (the engine
    places a prefix at consecutive positions)."""
    rec = getattr(model, "compressor_record", None)
    if rec is not None and rec["name"] not in SETTING_ONLY:
        raise KTMError(f"this model's checkpoint was trained with --compressor {rec['name']} "
                       f"({COMPRESSOR_RECORD}): its LoRA reads prompts as {rec['name']} "
                       f"rewrote them, {engine} would read them as given; expected a checkpoint "
                       "trained without a baseline (ktm eval and ktm generate apply its method)")
    if getattr(model, "input_extension", None) is not None:
        raise KTMError("this model has LTSC meta-token rows beyond the LM's vocabulary; the "
                       f"{engine} export covers K-token merging models only")
    if model.config.spread_positions:
        raise KTMError(f"this model uses spread_positions (a merged block at its last token's "
                       f"position), but {engine} reads a sequence only at consecutive "
                       "positions: it would read the prefix differently; expected a "
                       "consecutive-position model, e.g. the shipped reader smollm2-135m-k2-seq "
                       "or smollm2-135m-k4-seq for the embedded model (or this one continued "
                       "with ktm pretrain --init ... --no-spread-positions)")
