"""A digest of what the embedded model reads: SmolLM2's prompt embeddings (plain, and merged by the
shipped K=4 reader) and target ids over 60 eval + 60 train examples of each task. A change that
must not alter what SmolLM2 reads prints the same digest before and after it.

Usage: python results/smollm2_prompt_hash.py
"""

import hashlib

import torch

from ktm.core.loss import target_ids
from ktm.model import KTMModel
from ktm.tasks import get_task

torch.manual_seed(0)
model = KTMModel.load("smollm2-135m-k4")
digest = hashlib.sha256()
for name, kw in [("tree", {"stage": "small"}), ("amazon", {}), ("commitpack", {})]:
    task = get_task(name, **kw)
    examples = task.eval_examples(60, seed=1) + task.train_examples(60, seed=0)
    with torch.no_grad():
        for merge in (False, True):
            for cp in model.compress([e.segments for e in examples], merge=merge):
                digest.update(cp.embeds.float().numpy().tobytes())
    for e in examples:
        digest.update(str(target_ids(model, e.target)).encode())
print(digest.hexdigest())
