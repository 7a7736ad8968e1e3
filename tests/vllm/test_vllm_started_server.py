"""ktm in front of a vLLM server it starts (``VLLMConfig(server=True)``, ``--vllm-server``): the
OpenAI server runs in its own process and the merged prefix goes to it over HTTP as
``prompt_embeds``. Greedy answers equal torch's, merged and plain, and closing the runtime ends
the server's process."""

import pytest

from ktm.core.prompt import Segment
from ktm.model import KTMModel
from ktm.vllm.runtime import VLLMConfig

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = [
    [Segment("The quick brown fox jumps over the lazy dog. " * 30),
     Segment("\nSummary:", compress=False)],
    [Segment("Tree: AB\n+CD\n++EF\n+GH\n++IJ\n+++KL\n" * 10),
     Segment("\nIs KL a child of IJ? Answer:", compress=False)],
]
NEW = 24


def test_a_started_server_answers_as_torch_and_ends_with_the_runtime():
    reader = KTMModel.load("smollm2-135m-k4-seq")
    want = {merge: reader.generate(PROMPTS, max_new_tokens=NEW, merge=merge)
            for merge in (True, False)}
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
