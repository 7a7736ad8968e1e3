import pytest
import torch
from helpers import perturb
from transformers import AutoModelForCausalLM

from ktm.core.loss import target_ids
from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.evaluation.evaluate import evaluate_classification, evaluate_task
from ktm.evaluation.label_scoring import decide, label_logprobs, label_prior
from ktm.model import KTMModel
from ktm.tasks import get_task
from ktm.tasks.base import Example

PROMPTS = ["Review: The quick brown fox jumps over the lazy dog.", "Review: def add(a, b): nope",
           "Review: hello world, my name is ktm", "Review: a b c d e f g"]
TARGETS = (" positive", " negative")


def _examples(labels=("positive", "negative", "positive", "negative")):
    return [Example((Segment(p),), " " + lab, lab) for p, lab in zip(PROMPTS, labels)]


def test_label_logprobs_match_the_base_model_by_hand(tiny_model_dir):
    """log p(answer | prompt), summed over the answer's tokens and its EOS, read off the plain
    HF model's logits one position at a time (K=1, untrained: the base model exactly)."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model = KTMModel.from_base(tiny_model_dir, k=1).eval()
    got, counts = label_logprobs(model, _examples()[:2], TARGETS)
    assert got.shape == (2, 2) and counts.tokens_in == counts.tokens_out
    for i, prompt in enumerate(PROMPTS[:2]):
        for j, target in enumerate(TARGETS):
            p = model.tokenizer(prompt)["input_ids"]
            t = target_ids(model, target)
            with torch.no_grad():
                logp = base(torch.tensor([p + t])).logits[0].log_softmax(-1)
            want = sum(float(logp[len(p) - 1 + n, tok]) for n, tok in enumerate(t))
            assert got[i, j].item() == pytest.approx(want, abs=1e-4)


def test_a_batch_scores_like_its_examples_one_by_one(tiny_model_dir):
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4).eval()
    perturb(model)
    whole, _ = label_logprobs(model, _examples(), TARGETS, batch_size=4)
    alone = torch.cat([label_logprobs(model, [e], TARGETS)[0] for e in _examples()])
    torch.testing.assert_close(whole, alone, atol=1e-4, rtol=1e-4)


def test_prior_is_the_mean_label_probability_and_correction_undoes_it():
    logp = torch.tensor([[-0.1, -3.0], [-0.2, -2.0], [-0.5, -1.0]])
    p = torch.softmax(logp, dim=1)
    torch.testing.assert_close(label_prior(logp), p.mean(dim=0))
    labels = ["positive", "negative"]
    assert decide(logp, labels) == ["positive"] * 3  # the uncorrected model leans one way
    # for two labels, the corrected decision is "p(label) above its mean"
    want = ["positive" if q > p[:, 0].mean() else "negative" for q in p[:, 0]]
    assert decide(logp, labels, label_prior(logp)) == want and "negative" in want


def test_calibration_lets_a_one_sided_model_answer_both_labels(tiny_model_dir):
    """Corrected with the prior on the very prompts it scores, a two-label decision is
    'p above its mean', so both labels occur unless every prompt scores alike."""
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=2)
    perturb(model, seed=3)
    ex = _examples()
    plain = evaluate_classification(model, ex, ["positive", "negative"], scoring="likelihood",
                                    targets=TARGETS)
    fixed = evaluate_classification(model, ex, ["positive", "negative"], scoring="likelihood",
                                    targets=TARGETS, calibration=ex)
    assert plain["unparsed"] == 0 and fixed["unparsed"] == 0
    assert set(fixed["predictions"]) == {"positive", "negative"}
    assert fixed["scoring"]["n_calibrate"] == 4 and plain["scoring"]["prior"] is None
    assert sum(fixed["scoring"]["prior"].values()) == pytest.approx(1.0)
    assert plain["balanced_accuracy"] == plain["scoring"]["uncorrected_balanced_accuracy"]


def test_a_task_scores_its_own_answer_texts(tiny_model_dir):
    """Tree answers are bare words, amazon's have a leading space: evaluate_task reads them
    from the task, so the scored text is the one the fine-tune was trained on."""
    model = KTMModel.from_base(tiny_model_dir, k=2)
    task = get_task("tree", stage="small", source="generate", num_trees=20)
    ex = task.eval_examples(4, seed=0)
    row = evaluate_task(model, task, ex, scoring="likelihood",
                        calibration=task.train_examples(4, seed=0))
    assert row["scoring"]["targets"] == ["true", "false"] and row["n"] == 4
    assert [e.target for e in ex] == [task.label_target(e.label) for e in ex]


@pytest.mark.data("amazon_reviews_fashion")
def test_amazon_answers_have_a_leading_space():
    assert get_task("amazon").label_target("positive") == " positive"


@pytest.mark.parametrize("kwargs,match", [
    ({"scoring": "vote"}, "scoring='vote': expected one of generate, likelihood"),
    ({"calibration": _examples()}, "needs scoring='likelihood'"),
    ({"scoring": "likelihood", "targets": [" positive"]}, "1 answer texts for 2 labels"),
])
def test_bad_scoring_options_are_errors(tiny_model_dir, kwargs, match):
    model = KTMModel.from_base(tiny_model_dir, k=2)
    with pytest.raises(KTMError, match=match):
        evaluate_classification(model, _examples(), ["positive", "negative"], **kwargs)
