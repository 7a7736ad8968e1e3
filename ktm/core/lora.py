"""Where LoRA goes: every attention and MLP projection of the base model, named per family.

PEFT's built-in default adapts only the query and value projections (GPT-2: ``c_attn``); the
paper adapts all of them. Each family names its projections differently (Phi-3 fuses q/k/v into
``qkv_proj`` and gate/up into ``gate_up_proj``; GPT-2 has ``c_attn``/``c_proj``/``c_fc``; OPT
``out_proj``/``fc1``/``fc2``), so the names come from this table. Asked-for names that a model
lacks are an error, never silently dropped: a partial match once left Phi-3 with LoRA on
``o_proj`` and ``down_proj`` only. A family missing from the table gets every linear layer
inside the model except the output head (what PEFT's ``"all-linear"`` picks), named in the
checkpoint config like any other. Names PEFT would not adapt as linear layers (on MoE families
whose experts transformers fuses into 3-D parameters, or on Mamba hybrids) are left out of the
defaults and refused when asked for.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft import LoraConfig
from torch import nn

from ktm.core.config import LoraSettings
from ktm.errors import KTMError

LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGETS: dict[str, tuple[str, ...]] = {
    **{family: LLAMA_LIKE for family in (
        "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
        "olmo", "olmo2", "cohere", "granite", "smollm3")},
    # its experts are fused 3-D parameters (``experts.gate_up_proj``), not linear modules
    "mixtral": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "opt": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
}
# linear layers whose weight the model reads directly, so a LoRA on them would never train
WEIGHT_READ: dict[str, tuple[str, ...]] = {
    "jamba": ("dt_proj",),  # its Mamba mixers compute dt_proj.weight @ x
}


def _module_names(lm: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, _ in lm.named_modules() if name}


def resolve_targets(lm: nn.Module, settings: LoraSettings) -> tuple[str, ...]:
    """The module names LoRA adapts: the ones asked for, else the family's from ``TARGETS``."""
    present = _module_names(lm)
    model_type = getattr(lm.config, "model_type", "?")
    if settings.target_modules is not None:
        targets, source = settings.target_modules, "target_modules"
    elif model_type in TARGETS:
        targets, source = TARGETS[model_type], f"the {model_type!r} entry of ktm.core.lora.TARGETS"
    else:
        targets, source = _all_linear(lm), "every linear layer but the head"
        if not targets:
            raise KTMError(f"no linear layers to adapt in this {model_type!r} model: pass "
                           "target_modules (--lora-target-modules)")
    missing = [t for t in targets if t not in present]
    if missing:
        raise KTMError(f"LoRA targets {missing} (from {source}) are not modules of this "
                       f"{model_type!r} model: expected names such as the last part of "
                       f"'model.layers.0.self_attn.q_proj'")
    refused = _peft_refuses(lm, targets) | (set(targets) & set(WEIGHT_READ.get(model_type, ())))
    if refused and settings.target_modules is not None:
        raise KTMError(f"LoRA targets {sorted(refused)} cannot be adapted on this {model_type!r} "
                       "model: PEFT moves them onto the fused 3-D expert parameters of its MoE "
                       "layers (which need lora_dropout 0 and drop the plain linear layers of "
                       "the same name) or refuses them on its Mamba layers, or the model reads "
                       "their weight directly (ktm.core.lora.WEIGHT_READ), so their LoRA would "
                       "never "
                       "train; expected other target_modules, such as the attention projections")
    targets = tuple(t for t in targets if t not in refused)
    if not targets:
        raise KTMError(f"no linear layers to adapt in this {model_type!r} model: pass "
                       "target_modules (--lora-target-modules)")
    return targets


def _peft_refuses(lm: nn.Module, targets) -> set[str]:
    """Names PEFT would not adapt as linear modules: on MoE families whose experts transformers 5
    fused into 3-D parameters (DeepSeek-V3, Qwen3-MoE, ...), PEFT retargets ``gate_proj`` /
    ``up_proj`` / ``down_proj`` / ``gate`` to those parameters, taking them off the dense and
    shared-expert linear layers; on Mamba hybrids (Falcon-H1) it refuses ``out_proj`` and
    ``conv1d``. Asked of PEFT itself, on a throwaway config."""
    try:
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # another PEFT: nothing known to move
        return set()
    probe = LoraConfig(target_modules=list(targets))
    try:
        convert_peft_config_for_transformers(probe, lm, None)
    except ValueError as e:  # half of a fused pair (gate_proj without up_proj)
        model_type = getattr(lm.config, "model_type", "?")
        raise KTMError(f"LoRA targets {list(targets)} cannot be adapted on this {model_type!r} "
                       f"model: {e}") from e
    refused = set(targets) - set(probe.target_modules or ())
    for name in set(targets) - refused:
        try:
            _check_lora_target_modules_mamba(probe, lm, name)
        except ValueError:
            refused.add(name)
    return refused


def _all_linear(lm: nn.Module) -> tuple[str, ...]:
    """Short names of the linear layers (``nn.Linear``, GPT-2-style ``Conv1D``), head excluded,
    and so are ``nn.Linear`` subclasses that do not return a tensor: a MoE router (Phi-MoE's,
    Llama-4's) returns a tuple, which PEFT's LoRA layer cannot add its update to."""
    # PEFT matches short names, so the head's name is dropped whatever else carries it
    head = lm.get_output_embeddings()
    names, skipped = set(), set()
    for n, m in lm.named_modules():
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":
            usable = m is not head and _returns_tensor(m)
            (names if usable else skipped).add(n.rsplit(".", 1)[-1])
    return tuple(sorted(names - skipped))


def _returns_tensor(m: nn.Module) -> bool:
    """True for a plain linear layer; a subclass with its own forward (Falcon's ``FalconLinear``
    is one, a MoE router another) is tried once on zeros."""
    if not isinstance(m, nn.Linear) or type(m).forward is nn.Linear.forward:
        return True
    with torch.no_grad():
        out = m(m.weight.new_zeros(1, 1, m.in_features))
    return isinstance(out, torch.Tensor) and out.shape[-1] == m.out_features


def lora_config(lm: nn.Module, settings: LoraSettings) -> LoraConfig:
    targets = resolve_targets(lm, settings)
    # GPT-2's Conv1D stores its weight transposed; PEFT needs to be told
    conv1d = any(type(m).__name__ == "Conv1D" and n.rsplit(".", 1)[-1] in targets
                 for n, m in lm.named_modules())
    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=list(targets), fan_in_fan_out=conv1d, task_type="CAUSAL_LM")


def adapted_modules(peft_model: nn.Module) -> dict[str, int]:
    """How many modules of each name carry a LoRA adapter (recorded in the checkpoint)."""
    counts: dict[str, int] = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and len(getattr(module, "lora_A", {})):
            short = name.rsplit(".", 1)[-1]
            counts[short] = counts.get(short, 0) + 1
    return dict(sorted(counts.items()))


@contextmanager
def peft_wrapping() -> Iterator[None]:
    """Wrap a base model in PEFT (``get_peft_model``, ``PeftModel.from_pretrained``) without
    transformers' FutureWarning that ``is_gradient_checkpointing`` is deprecated: PEFT's
    ``PeftModel.__init__`` reads that property of every model it wraps, so each model ktm built
    or loaded printed it to the user. Only that message is silenced, only here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        yield
