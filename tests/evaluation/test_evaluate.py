import pytest
import torch
from helpers import perturb

from ktm.core.config import LoraSettings
from ktm.core.prompt import Segment
from ktm.decode.generate import eval_mode
from ktm.evaluation.evaluate import evaluate_perplexity
from ktm.model import KTMModel
from ktm.tasks.base import Example

EXAMPLES = [Example((Segment("The quick brown fox jumps over the lazy dog."),), "Hello world"),
            Example((Segment("def add(a, b):\n    return a + b"),), "my name is ktm")]


def test_perplexity_is_measured_in_eval_mode(tiny_model_dir):
    """LoRA dropout must be off while scoring, whatever mode the caller left the model in."""
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4, lora=LoraSettings(dropout=0.5))
    perturb(model)
    model.eval()
    reference = evaluate_perplexity(model, EXAMPLES)["perplexity"]
    model.train()
    scores = [evaluate_perplexity(model, EXAMPLES)["perplexity"] for _ in range(3)]
    assert scores == [reference] * 3
    assert model.training  # the caller's mode comes back


def test_merging_time_waits_for_the_device(ktm_model, monkeypatch):
    """compression_s times the encoder's kernels on CUDA, not only their launch: every clock
    read around the merging waits for the model's device (``ktm.util.timing.clock``)."""
    import ktm.evaluation.evaluate as evaluate
    import ktm.util.timing as timing

    seen = []

    def fake_clock(device):
        seen.append(device)
        return float(len(seen))  # each timed merging takes 1 s on this clock

    monkeypatch.setattr(timing, "clock", fake_clock)  # what ktm.util.timing.timed reads
    labelled = [Example(e.segments, label) for e, label in zip(EXAMPLES, ("yes", "no"))]
    rows = [evaluate_perplexity(ktm_model, EXAMPLES, batch_size=1),
            evaluate.evaluate_classification(ktm_model, labelled, ["yes", "no"], batch_size=1,
                                             max_new_tokens=1),
            evaluate.evaluate_classification(ktm_model, labelled, ["yes", "no"], batch_size=1,
                                             scoring="likelihood")]
    assert [r["compression_s"] for r in rows] == [2.0, 2.0, 2.0]  # two batches each
    assert len(seen) == 12 and set(seen) == {ktm_model.device}


def test_perplexity_pools_tokens_and_length_reduction_pools_totals(ktm_model):
    """Hand-computed: perplexity is exp(total NLL / total target tokens), not a mean of
    per-example perplexities, and length reduction is 1 - total after / total before."""
    import math

    res = evaluate_perplexity(ktm_model, EXAMPLES, batch_size=1)
    with torch.no_grad(), eval_mode(ktm_model):
        outs = [ktm_model([e.segments], [e.target]) for e in EXAMPLES]
    nll = sum(float(o.nll.sum()) for o in outs)
    n_tok = sum(int(o.n_tokens.sum()) for o in outs)
    assert res["target_tokens"] == n_tok
    assert res["perplexity"] == pytest.approx(math.exp(nll / n_tok), rel=1e-5)
    per_example = [math.exp(float(o.nll.sum()) / int(o.n_tokens.sum())) for o in outs]
    assert res["perplexity"] != pytest.approx(sum(per_example) / 2, rel=1e-6)
    before = sum(o.tokens_in for o in outs)
    after = sum(o.tokens_out for o in outs)
    assert res["length_reduction"] == pytest.approx(1 - after / before)
    assert res["tokens_before"] == before / 2
