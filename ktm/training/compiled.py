"""Training steps through a compiled LM body (``ktm train --compile``, ``ktm bench --mode train
--compile off on``).

The base LM's body (``get_decoder()``: every decoder layer, PEFT's LoRA inside) is compiled once
with dynamic shapes (``torch.compile(dynamic=True)``): inductor fuses its norms, rotary
embedding, activations and LoRA's small ops, forward and backward, into fewer kernels. The
embedding lookup, the encoder, the head (it reads a data-dependent set of target positions) and
the loss stay eager. There is no CUDA graph: training windows vary in length.

The body is compiled only inside ``compiled_body`` (a training step): evaluation and decoding
between steps read the eager modules. The compiled function is kept per body, so entering again
compiles nothing new.

Where it pays (``resolve``): ``auto`` compiles on the device types in ``PAYS``, none measured to
pay yet (``results/bench/README.md``); ``on`` compiles on every device.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager

import torch

from ktm.decode.compiled import check_mode

# device types where ``auto`` trains through the compiled body: none measured to pay yet
PAYS: frozenset[str] = frozenset()
# body module -> its compiled forward, made once
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def resolve(mode: str, device: torch.device) -> bool:
    """Whether training steps run through the compiled body on ``device`` under ``mode``."""
    check_mode(mode)
    return mode == "on" or (mode == "auto" and torch.device(device).type in PAYS)


@contextmanager
def compiled_body(model, on: bool = True):
    """Inside: the LM body's forward is its compiled one (``on``), else untouched."""
    if not on:
        yield
        return
    body = model.peft.get_base_model().get_decoder()
    fn = _COMPILED.get(body)
    if fn is None:
        print("ktm: compiling the LM body for training (once per process)", file=sys.stderr,
              flush=True)
        # the class's forward bound to this body: compiling the attribute set below would
        # compile itself
        fn = _COMPILED[body] = torch.compile(type(body).forward.__get__(body), dynamic=True)
    body.forward = fn
    try:
        yield
    finally:
        del body.forward
