"""Does a reader loaded back frozen merge exactly as the trainable one saved? On a device, in fp32.

A K=4 reader with layer-state context (mean pool, then pooled queries) is built and perturbed,
saved, and loaded back frozen (``trainable=False``, the default) and trainable; the largest
difference of encoder weights, LoRA weights, merged vectors and logits is printed, with the
layer states and the context branch alone on a short unpadded prompt. Output of one run:
``frozen_vs_trainable.txt``.

    python results/device/frozen_vs_trainable.py [cuda]
"""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers import PROMPTS, TARGETS, perturb, save_tiny_llama  # noqa: E402

from ktm.core.loss import target_logits
from ktm.model import KTMModel  # noqa: E402

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def build(base: str, pool: str) -> KTMModel:
    torch.manual_seed(0)
    model = KTMModel.from_base(base, k=4, inner_k=2, slot_weights=True, device=DEVICE,
                               dtype="float32", context_layers=1, context_pool=pool)
    perturb(model, seed=1)
    return model.eval()


def main() -> None:
    base = tempfile.mkdtemp()
    save_tiny_llama(base)
    for pool in ("mean", "query"):
        model = build(base, pool)
        with torch.no_grad():
            first = [c.embeds for c in model.encode_prompts(PROMPTS)]
            again = [c.embeds for c in model.encode_prompts(PROMPTS)]
            print(pool, "same model twice:", max(diff(a, b) for a, b in zip(first, again)))
            saved = tempfile.mkdtemp() + "/ck"
            model.save(saved)
            for trainable in (False, True):
                other = KTMModel.load(saved, device=DEVICE, dtype="float32",
                                      trainable=trainable).eval()
                own, its = model.encoder.state_dict(), other.encoder.state_dict()
                lora = max(diff(a, b) for (_, a), (_, b) in zip(model.peft.named_parameters(),
                                                                other.peft.named_parameters()))
                print(" trainable", trainable, "enc weights max diff",
                      max(diff(own[k], its[k]) for k in own), "lora", lora)
                merged = [c.embeds for c in other.encode_prompts(PROMPTS)]
                print("  embeds", max(diff(a, b) for a, b in zip(first, merged)))
                print("  logits", diff(target_logits(model, PROMPTS, TARGETS).logits,
                                       target_logits(other, PROMPTS, TARGETS).logits))
                if pool == "query":
                    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]], device=DEVICE)
                    emb, mask = model.input_embedding(ids), torch.ones_like(ids, dtype=torch.bool)
                    a, b = model.encoder.states, other.encoder.states
                    print("  layer states", diff(a.source(emb, mask), b.source(emb, mask)))
                    print("  states out", diff(a(emb, mask), b(emb, mask)))
                    print("  states twice same model", diff(a(emb, mask), a(emb, mask)))


if __name__ == "__main__":
    main()
