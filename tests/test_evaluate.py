import torch
from test_model import perturb

from ktm.evaluate import evaluate_perplexity
from ktm.model import KTMModel, LoraSettings
from ktm.prompt import Segment
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
