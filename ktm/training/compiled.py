"""Training steps through a compiled LM body (``ktm train --compile``, ``ktm bench --mode train
--compile off on``).

The base LM's decoder layers (PEFT's LoRA inside) run through one function compiled with dynamic
shapes (``torch.compile(dynamic=True)``) that every layer shares: inductor fuses a layer's norms,
rotary embedding, activations and LoRA's small ops, forward and backward, into fewer kernels, and
the layer is compiled once rather than the whole stack unrolled (a whole 0.5B body, forward and
backward, did not finish compiling in 190 s on an H200). The embedding lookup, the encoder, the
head (it reads a data-dependent set of target positions) and the loss stay eager. There is no
CUDA graph: training windows vary in length.

The layers run compiled only inside ``compiled_body`` (a training step): evaluation and
decoding between steps read the eager modules. The compiled function is kept per layer class, so
entering again compiles nothing new.

Where it pays (``resolve``), measured on one H200 at Qwen2.5-0.5B's shape, bf16, batch 8 of 4,096
tokens, in mixed precision (``results/bench/README.md``): a step takes 0.291 s against eager's
0.413 plain (MFU 30.7 % against 21.6 %), 0.169 against 0.214 with K=4. So ``auto`` compiles
on CUDA, not on the CPU (not measured there at a real size); ``on`` compiles on every device.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager

import torch

from ktm.decode.compiled import check_mode, room_for_shapes
from ktm.errors import KTMError

# device types where ``auto`` trains through the compiled layers (the module docstring)
PAYS = frozenset({"cuda"})
# Inductor's C++ kernels (the CPU; CUDA's Triton kernels read nothing here) run on one thread.
# torch 2.13 miscompiles a scatter-add inside a 2-D tiled (transposing) kernel when it writes
# for several threads: the atomic add offsets its index by the inner tile variable twice, so it
# adds into the wrong elements, or past the buffer (pytorch/pytorch#191837, proposed fix #191861).
# Falcon's multi-query attention meets it: the backward of picking K and V out of the fused QKV
# by a list index is such a scatter, and its LoRA gradients came out 0.6 off eager's (2 threads,
# AMD EPYC), the loss unchanged. One thread takes inductor's plain ``+=`` store, which is right;
# the matmuls still run on every thread.
INDUCTOR_OPTIONS = {"cpp.threads": 1}
# decoder layer class -> its forward as training steps run it (compiled, or the class's own where
# the compile failed), shared by every layer of that class
_COMPILED: dict[type, object] = {}


def resolve(mode: str, device: torch.device) -> bool:
    """Whether training steps run through the compiled body on ``device`` under ``mode``."""
    check_mode(mode)
    return mode == "on" or (mode == "auto" and torch.device(device).type in PAYS)


@contextmanager
def compiled_body(model, on: bool = True):
    """Inside: the LM's decoder layers run their compiled forward (``on``), else untouched."""
    if not on:
        yield
        return
    layers = decoder_layers(model)
    for layer in layers:
        cls = type(layer)
        if cls not in _COMPILED:
            print(f"ktm: compiling {cls.__name__} for training (once per process)",
                  file=sys.stderr, flush=True)
            _COMPILED[cls] = _compiled_forward(cls)
        layer.forward = functools.partial(_COMPILED[cls], layer)
    try:
        # past torch's 8 graphs a function, it would go eager unsaid; and dynamo guards on the
        # layers' hooks, which it skips by default (skip_nnmodule_hook_guards): the compiled
        # forward is shared by every model of the process, and a LoRA of the merged rows only
        # (``ktm.core.lora_scope``) is a forward hook, so a graph traced for a model without it
        # would otherwise run for one with it, its LoRA on every row
        with room_for_shapes(), torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
            yield
    finally:
        for layer in layers:
            del layer.forward


def _compiled_forward(cls: type):
    """``cls.forward`` compiled with dynamic shapes. Where inductor cannot compile it (Jamba's
    Mamba layers: their scan tests a length that is symbolic under dynamic shapes), that call
    and every later one run the class's own forward, and one line says so. A layer in training
    writes no state (no KV cache), so the failed call is simply made again."""
    fn = torch.compile(cls.forward, dynamic=True, options=INDUCTOR_OPTIONS)

    def forward(layer, *args, **kwargs):
        if _COMPILED[cls] is not forward:  # eager since a failed compile
            return cls.forward(layer, *args, **kwargs)
        try:
            return fn(layer, *args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(f"ktm: {cls.__name__} did not compile for training ({why[:200]}); its layers "
                  "train eager", file=sys.stderr, flush=True)
            _COMPILED[cls] = cls.forward
            return cls.forward(layer, *args, **kwargs)

    return forward


def decoder_layers(model) -> list[torch.nn.Module]:
    """The base LM's decoder layers: the module list of ``num_hidden_layers`` in its body."""
    body = model.peft.get_base_model().get_decoder()
    count = model.lm_config.num_hidden_layers
    for module in body.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return list(module)
    raise KTMError(f"no list of {count} decoder layers in {type(body).__name__}: expected one "
                   "(compile='off' trains it eager)")
