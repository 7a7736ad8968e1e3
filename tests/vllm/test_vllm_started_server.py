"""ktm in front of a vLLM server it starts (``VLLMConfig(server=True)``, ``--vllm-server``): the
OpenAI server runs in its own process and the merged prefix goes to it over HTTP as
``prompt_embeds``. The model is the question reader, whose LoRA adapts the merged rows only: vLLM
serves it without its LoRA (``ktm.vllm.export.LORA_ROWS``), so its greedy answers, merged and
plain, equal torch's reading of it with the LoRA zeroed. Closing the runtime ends the server's
process."""

import pytest
from helpers import zero_lora

from ktm.core.prompt import Segment
from ktm.model import KTMModel
from ktm.vllm.runtime import VLLMConfig

# one started vLLM server at a time (a process holding a model and a GB of KV cache), beside
# tests/serving/test_serve_exposed.py's; as a group of two, xdist hands them out before the
# single tests, so the run does not end waiting on a server start
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.xdist_group("vllm-server")]

PROMPTS = [
    [Segment("The quick brown fox jumps over the lazy dog. " * 30),
     Segment("\nSummary:", compress=False)],
    [Segment("Tree: AB\n+CD\n++EF\n+GH\n++IJ\n+++KL\n" * 10),
     Segment("\nIs KL a child of IJ? Answer:", compress=False)],
    [Segment("# The secret code for Ada is 4417.\n" + "x = compute(y)\n" * 60),
     Segment("\nQuestion: what is the secret code for Ada? Answer:", question=True)],
]
NEW = 24
READER = "smollm2-135m-k4-qa"


def test_a_started_server_answers_as_torch_and_ends_with_the_runtime():
    zeroed = zero_lora(KTMModel.load(READER))
    want = {merge: zeroed.generate(PROMPTS, max_new_tokens=NEW, merge=merge)
            for merge in (True, False)}
    reader = KTMModel.load(READER)
    assert reader.generate(PROMPTS, max_new_tokens=NEW) != want[True]  # its LoRA reads
    with pytest.warns(UserWarning, match="vLLM serves this model's LM without its LoRA"):
        reader.use_backend("vllm", config=VLLMConfig(server=True, kv_cache_gb=1.0))
    proc = reader.runtime.proc
    try:
        assert proc is not None and proc.poll() is None  # a server process of its own
        for merge in (True, False):
            assert reader.generate(PROMPTS, max_new_tokens=NEW, merge=merge) == want[merge]
        assert "".join(reader.stream(PROMPTS[0], max_new_tokens=NEW)) == want[True][0]
    finally:
        reader.use_backend("torch")
    assert proc.wait(timeout=60) is not None  # the server ended with its runtime
