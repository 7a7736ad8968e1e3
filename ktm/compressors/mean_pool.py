"""Mean pooling: the K-token encoder without its MLP, ``C_i = mean(e_1 .. e_K)``.

Not a text rewrite but a model setting: the compressor asks for ``use_mlp=False`` (the same model
as ``KTMModel.from_base(..., use_mlp=False)`` or ``ktm train --no-mlp``) and leaves prompts as
they are; K comes from the model.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ktm.compressors.base import Compressor
from ktm.core.prompt import Segment


class MeanPool(Compressor):
    name: ClassVar[str] = "mean_pool"
    model_kwargs: ClassVar[dict[str, Any]] = {"use_mlp": False}
    rewrites_prompts: ClassVar[bool] = False

    def rewrite(self, texts: list[str], first: list[bool]) -> list[Segment]:
        return [Segment(t) for t in texts]  # the merging happens inside the model
