"""The default llama.cpp export, as users run it (the embedded Q4_1 base with the LoRA folded into
Q8_0, an f16 KV cache), against torch fp32 on 700 to 1,700-token prompts, merged and plain.

Its logits are not torch's (quantised kernels, an f16 cache), so the checks are bounds: the
next-token log-probabilities of torch's 20 most likely tokens after the prompt lie within
``BOUND`` of torch's, and greedy decoding gives torch's tokens up to the first step where torch's
top-2 margin is under ``2 * BOUND``, where the two could swap places; past that point the two
may continue differently."""

from pathlib import Path

import pytest
import torch

from ktm.core.prompt import Segment
from ktm.decode.generate import GenerationConfig
from ktm.model import KTMModel

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]

BOUND = 0.45  # log-prob units; 0.30 was the largest seen on these prompts
NEW = 32
ROOT = Path(__file__).parents[2] / "ktm"
SOURCE = "".join((ROOT / f).read_text() for f in ("decode/generate.py", "serving/engine.py"))
QUESTION = "\nQuestion: what does this code do? Answer:"
CASES = [(0, 2600, True), (9000, 2600, True), (0, 4000, True), (9000, 6000, True),
         (0, 2600, False), (9000, 4000, False)]


@pytest.fixture(scope="module")
def pair():
    torch_model = KTMModel.load("smollm2-135m-k4-seq")
    llama = KTMModel.load("smollm2-135m-k4-seq", backend="llamacpp")  # every default
    yield torch_model, llama
    llama.use_backend("torch")


def greedy(model, cp) -> tuple[list[int], list[float], torch.Tensor]:
    """Greedy tokens, torch's top-2 margin at each step, and the first step's logits."""
    rt, cfg = model.runtime, GenerationConfig(max_new_tokens=NEW, stop_at_eos=False)
    state = rt.prefill([cp], [cfg])
    first = state.logits[0].float().clone()
    tokens, margins = [], []
    try:
        for i in range(NEW):
            top = state.logits[0].float().topk(2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            if i + 1 < NEW:
                rt.advance(state, torch.tensor([tokens[-1]]))
    finally:
        rt.release(state)
    return tokens, margins, first


@pytest.mark.parametrize("start, chars, merge", CASES)
def test_the_default_export_reads_long_prompts_as_torch_does(pair, start, chars, merge):
    torch_model, llama = pair
    prompt = [Segment(SOURCE[start:start + chars]), Segment(QUESTION, compress=False)]
    cp = torch_model.encode_prompts([prompt], merge)[0]
    assert 600 <= cp.tokens_in <= 1800
    want, margins, want_logits = greedy(torch_model, cp)
    got, _, got_logits = greedy(llama, cp)
    top = want_logits.topk(20).indices
    gap = (want_logits.log_softmax(-1) - got_logits.log_softmax(-1))[top].abs().max()
    assert gap <= BOUND
    near_tie = next((i for i, m in enumerate(margins) if m < 2 * BOUND), NEW)
    assert got[:near_tie] == want[:near_tie]
