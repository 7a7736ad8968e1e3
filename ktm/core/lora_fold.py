"""The LM with its LoRA folded into separate weights, ``W + s B A``: what decoding reads through.

PEFT's LoRA layer runs the base projection and then two small matmuls (``x A^T B^T``) and its own
Python on every call. Decoding SmolLM2-135M on a CPU, that is 420 extra matmul calls a token for
its 210 adapted projections, about a sixth of a decode step. Folding the LoRA into the weight
removes them.

PEFT's ``merge_adapter`` folds in place and ``unmerge_adapter`` subtracts the update back, which
leaves every base weight a rounding off after each round trip; ``disable_adapter`` (the
uncompressed baselines, distillation's teacher) unmerges a merged layer in place too. So the
base weights are never touched here. ``FoldedLM`` builds a *view* of the LM instead: the adapted
projections are copies of their base layers holding folded weights, and every other module (the
embeddings, norms, the head) is the LM's own, shared.

What it costs: one more copy of every adapted weight while the view lives. For the Llama-like
families that is nearly all of the weights outside the embeddings: +0.43 GB for SmolLM2-135M in
fp32, about +13 GB for a 7B model in bf16. That is why ``KTMModel`` folds by default only for a
model whose LoRA does not train (``load(..., trainable=False)``): a training run's evaluation
would need that memory on top of the optimizer's.
"""

from __future__ import annotations

import copy

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ktm.core.int8 import int8_swaps, linears
from ktm.core.lora_scope import RowSwitch
from ktm.errors import KTMError


def _foldable(layer: nn.Module) -> bool:
    """A plain PEFT LoRA linear layer (no DoRA or other variant, no LoRA bias), adapters on,
    not already merged into its own weights."""
    if type(layer) is not LoraLinear or layer.disable_adapters or layer.merged:
        return False
    return all(a not in getattr(layer, "lora_variant", {}) and not layer.lora_bias.get(a, False)
               for a in layer.active_adapters)


@torch.no_grad()
def folded_weight(layer: LoraLinear) -> torch.Tensor:
    """The base weight plus each active adapter's ``s B A`` (PEFT's own ``get_delta_weight``,
    which knows GPT-2's transposed ``Conv1D``), summed in fp32 and rounded once to the weight's
    dtype: the weight PEFT's ``merge`` would write in place."""
    w = layer.get_base_layer().weight
    out = w.detach().float()
    for a in layer.active_adapters:
        if a in layer.lora_A:
            out = out + layer.get_delta_weight(a).float()
    return out.to(w.dtype)


def _folded_layer(layer: LoraLinear) -> nn.Module:
    """A copy of the layer's base module (``nn.Linear``, ``Conv1D``, ...) with the folded weight;
    its bias and anything else are the base module's own."""
    base = layer.get_base_layer()
    clone = copy.copy(base)
    clone._parameters = dict(base._parameters)  # copy.copy shared the dict itself
    clone._parameters["weight"] = nn.Parameter(folded_weight(layer), requires_grad=False)
    clone.training = False
    return clone


def _tuners(lm: nn.Module) -> dict[str, BaseTunerLayer]:
    return {n: m for n, m in lm.named_modules() if isinstance(m, BaseTunerLayer)}


def _ancestor_names(names) -> set[str]:
    """Every module on the way to the named ones, the root ("") included."""
    return {""} | {n.rsplit(".", i)[0] for n in names for i in range(1, n.count(".") + 1)}


def fold_view(lm: nn.Module, tuners: dict[str, BaseTunerLayer] | None = None
              ) -> nn.Module | None:
    """``lm`` with each LoRA layer (``tuners``: found if not given) replaced by its folded base
    layer; None if one cannot be folded (a LoRA variant, adapters disabled, PEFT's in-place
    merge). Only the modules on the way to a LoRA layer are copied (shallowly, each with a child
    table of its own); the rest are ``lm``'s, shared. The copies are in eval mode: the view is
    for decoding."""
    tuners = _tuners(lm) if tuners is None else tuners
    if not tuners or not all(_foldable(m) for m in tuners.values()):
        return None
    return swapped_view(lm, {n: _folded_layer(m) for n, m in tuners.items()})


def base_view(lm: nn.Module) -> nn.Module:
    """``lm`` with each LoRA layer replaced by its base module: the base LM, sharing every
    weight; what a LoRA of scope "merged" reads a forward of plain rows with
    (``ktm.core.lora_scope``)."""
    swaps = {n: m.get_base_layer() for n, m in _tuners(lm).items()}
    return swapped_view(lm, swaps) if swaps else lm


def rows_view(lm: nn.Module, tuners: dict[str, BaseTunerLayer] | None = None
              ) -> nn.Module | None:
    """``lm`` with each LoRA layer replaced by a switch between its folded weight, at the rows
    the running forward's gate marks, and its base module, at the rest (``ktm.core.lora_scope``,
    ``RowSwitch``): what a LoRA of scope "merged" prefills through, the same rows adapted as
    PEFT's layer with the gate's hook adapts, without its two small matmuls and the gate's
    multiply on every row. None if a layer cannot be folded."""
    tuners = _tuners(lm) if tuners is None else tuners
    if not tuners or not all(_foldable(m) for m in tuners.values()):
        return None
    return swapped_view(lm, {n: RowSwitch(_folded_layer(m), m.get_base_layer())
                             for n, m in tuners.items()})


def swapped_view(root: nn.Module, swaps: dict[str, nn.Module]) -> nn.Module:
    """``root`` with the modules named in ``swaps`` replaced: only the modules on the way to them
    are copied (shallowly, each with a child table of its own, in eval mode); the rest are
    ``root``'s, shared."""
    ancestors = _ancestor_names(swaps)

    def rebuild(module: nn.Module, prefix: str) -> nn.Module:
        children = {}
        for name, child in module._modules.items():
            path = prefix + name
            if path in swaps:
                child = swaps[path]
            elif path in ancestors:
                child = rebuild(child, path + ".")
            children[name] = child
        clone = copy.copy(module)
        clone._modules = children
        clone.training = False
        return clone

    return rebuild(root, "")


def _state(t: torch.Tensor) -> tuple:
    # a tensor made under inference_mode keeps no version (and cannot be changed outside it)
    return id(t), t.data_ptr(), None if t.is_inference() else t._version


# the views ``FoldedLM`` makes, by mode: each from the LM and its LoRA layers
VIEWS = {"fold": fold_view, "base": lambda lm, _: base_view(lm), "rows": rows_view}


class FoldedLM:
    """A ``fold_view`` of an LM, made on first use and made again once what it was made from
    changes. Not a module: its weights are in no ``state_dict``, never saved, never trained.

    Checked on each ``get``, cheaply (no walk over the LM): each LoRA layer's switches, the
    identity, storage and in-place version of its base weight and LoRA factors (training steps,
    ``load_state_dict``, an EMA swap and ``.to()`` change them; a write through ``.data`` does
    not: autograd's version counter skips it), and the children of each module the view copied.
    Other modules are the LM's own, so a change inside one is the view's too.

    Three views of the LM, each made when first asked for and kept beside the others: "fold"
    (the LoRA folded in), "base" (the base LM's modules, nothing copied) and "rows" (folded at
    the gated rows, base at the rest: ``rows_view``).

    ``weights="int8"`` (``ktm.core.int8``): a second view whose every linear layer is an int8
    copy, kept beside the first (a quarter of its bytes in fp32), so that runs switching between
    the two (``ktm bench --weights native int8``) quantize once; the check then covers the
    weight of every linear layer of the LM as well."""

    def __init__(self) -> None:
        self._views: dict[tuple[str, str], nn.Module | None] = {}  # by (mode, weights)
        self._key: tuple | None = None
        self._lm: nn.Module | None = None
        self._tuners: list[tuple] = []  # (LoRA layer, its base module, [(adapter, A, B)])
        self._parents: list[nn.Module] = []
        self._linears: list[nn.Module] = []  # every nn.Linear, checked while an int8 view lives

    def _scan(self, lm: nn.Module) -> dict[str, BaseTunerLayer]:
        """Find the LoRA layers and the modules on the way to them; hold the modules a check
        reads (looking them up through the layer each time costs more than the check)."""
        tuners = _tuners(lm)
        names = _ancestor_names(tuners)
        self._lm = lm
        self._tuners = [(t, t.get_base_layer(), [(a, t.lora_A[a], t.lora_B[a]) for a in t.lora_A])
                        for t in tuners.values()]
        self._parents = [m for n, m in lm.named_modules() if n in names]
        return tuners

    def _current(self) -> tuple:
        layers = []
        for t, base, factors in self._tuners:
            row = [t.disable_adapters, t.merged, tuple(t.active_adapters),
                   _state(base._parameters["weight"])]
            row += [(t.scaling.get(a), _state(la._parameters["weight"]),
                     _state(lb._parameters["weight"])) for a, la, lb in factors]
            layers.append(tuple(row))
        children = tuple(tuple(map(id, m._modules.values())) for m in self._parents)
        plain = tuple(_state(m._parameters["weight"]) for m in self._linears)
        return tuple(layers), children, plain

    def lora_trains(self, lm: nn.Module) -> bool:
        """Whether a LoRA weight of ``lm`` requires a gradient."""
        if lm is not self._lm:
            self.clear()
            self._scan(lm)
        return any(m._parameters["weight"].requires_grad for _, _, factors in self._tuners
                   for _, la, lb in factors for m in (la, lb))

    def get(self, lm: nn.Module, weights: str = "native", mode: str = "fold"
            ) -> nn.Module | None:
        """The ``mode`` view of ``lm`` as its weights are now: "fold", the LoRA folded in (None
        when it cannot be folded and ``weights`` is "native"); "base", every LoRA layer's base
        module in its place (``base_view``: what a LoRA of scope "merged" decodes through);
        "rows", folded at the gated rows only (``rows_view``; None when it cannot be folded).
        ``weights="int8"``: its linear layers in int8 (``ktm.core.int8``); a LoRA that cannot be
        folded is then refused by name."""
        if mode not in VIEWS:
            raise KTMError(f"view mode {mode!r}: expected one of {', '.join(VIEWS)}")
        if lm is not self._lm or self._key is None or self._current() != self._key:
            self.clear()  # the old copies go before new ones are made: never two at once
        if (mode, weights) not in self._views:
            tuners = self._scan(lm)
            view = self._views.get((mode, "native"))
            if (mode, "native") not in self._views:
                view = VIEWS[mode](lm, tuners)
            if weights == "int8":
                if mode == "rows":
                    raise KTMError("weights='int8' reads the LM in int8 with its LoRA folded in "
                                   "or left out, not switched by row: expected mode 'fold' or "
                                   "'base'")
                if view is None and tuners:
                    raise KTMError("weights='int8' reads the LM with its LoRA folded in, and "
                                   "this LoRA cannot be folded (a LoRA variant or bias, adapters "
                                   "disabled, or merged in place): use weights='native'")
                self._linears = list(linears(lm).values())
                base = lm if view is None else view
                view = swapped_view(base, int8_swaps(base))
            self._views[(mode, weights)], self._key = view, self._current()
        return self._views[(mode, weights)]

    def clear(self) -> None:
        """Free the folded weights."""
        self._views, self._key, self._linears = {}, None, []
