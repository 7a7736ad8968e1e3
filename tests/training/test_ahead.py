"""The training loop's windows tokenized a step ahead (``ktm.training.ahead``): a window given
as ids reads exactly as its text, the worker hands the windows over in order, and an error in
a window is raised at the step that needs it."""

import pytest
import torch
from helpers import TEXT, fresh_model, perturb

from ktm import KTMError, Segment
from ktm.core.config import LoraSettings
from ktm.model import trainable_parameters
from ktm.tasks.base import Example
from ktm.training.ahead import Ahead, tokenized

EXAMPLES = [
    Example((Segment(TEXT),), " yes"),
    # an empty segment first: the next one is the prompt's first, and gets the lead tokens
    Example((Segment(""), Segment("Tree: AB\n+CD\n++EF"),
             Segment(", Parent: AB, Answer: ", compress=False)), " true"),
    Example((Segment("Hello world, " * 6, ratio=2.0), Segment(" Q:", compress=False)), " no"),
    Example((Segment("", ids=(5, 6, 7, 8, 9)), Segment("more text here")), [11, 12]),
]


def _loss_and_grads(model, window):
    model.zero_grad(set_to_none=True)
    out = model([e.segments for e in window], [e.target for e in window])
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in trainable_parameters(model)
                               if p.grad is not None}


@pytest.fixture(scope="module", params=["plain", "bos"])
def model(request, tiny_model_dir, tiny_bos_model_dir):
    """A tokenizer without and with lead tokens (only a prompt's first segment gets them)."""
    m = fresh_model(tiny_bos_model_dir if request.param == "bos" else tiny_model_dir,
                    lora=LoraSettings(dropout=0.0))
    perturb(m)
    return m.train()


def test_a_tokenized_window_reads_as_its_text(model):
    window = [tokenized(model, e) for e in EXAMPLES]
    for e, t in zip(EXAMPLES, window):
        assert all(s.ids is not None for s in t.segments)
        assert [s.text for s in t.segments] == [s.text for s in e.segments if s.text or s.ids]
        assert not isinstance(t.target, str) and t.label == e.label
    assert window[3].segments[0].ids == (5, 6, 7, 8, 9) and window[3].target == [11, 12]
    assert window[0].target[-1] == model.eos_id  # a text target's EOS, as the loss adds it
    want, want_grads = _loss_and_grads(model, EXAMPLES)
    got, grads = _loss_and_grads(model, window)
    assert torch.equal(got, want)
    assert grads.keys() == want_grads.keys() and grads
    for name, g in grads.items():
        assert torch.equal(g, want_grads[name]), name


def test_ahead_hands_each_window_over_in_order_and_raises_a_bad_one_at_its_step(model):
    bad = Example((Segment("a lone surrogate \ud800 here"),), " yes")  # no tokenizer takes it
    windows = [EXAMPLES[:2], EXAMPLES[2:], [bad], EXAMPLES[:1]]
    asked = []

    def window_at(i):
        asked.append(i)
        return windows[i] if i < len(windows) else None

    ahead = Ahead(model)
    try:
        for step in range(2):
            got = ahead.take(step, window_at)
            assert got == [tokenized(model, e) for e in windows[step]]
        assert asked == [0, 1, 2]  # each window asked for once, a step ahead
        with pytest.raises(KTMError, match="surrogate"):
            ahead.take(2, window_at)  # the worker's error, at the step that needs it
        assert ahead.take(3, window_at) == [tokenized(model, EXAMPLES[0])]
        assert asked == [0, 1, 2, 3, 4]
    finally:
        ahead.close()
