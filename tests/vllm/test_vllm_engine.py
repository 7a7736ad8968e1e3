"""The vLLM backend on a real vLLM engine (the CPU build): the shipped reader
``smollm2-135m-k4-seq`` in fp32 on one engine shared by the run (``vllm_reader``), against the
same reader on torch. Greedy parity merged and plain, batching, streaming, scoring, bad input,
and ``ktm serve`` in front of it: concurrent requests, dropped streams and bad requests leave the
answers as they were."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from ktm.core.batch import CompressedPrompt
from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.model import KTMModel, RuntimeSpec
from ktm.serving.app import BackgroundServer, create_app
from ktm.serving.config import ServeConfig

# one worker runs these under pytest-xdist (--dist loadgroup): the engine starts once
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.xdist_group("vllm-engine")]

SOURCE = (Path(__file__).parents[2] / "ktm" / "decode" / "generate.py").read_text()
PROMPTS = [
    [Segment(SOURCE[:4200]), Segment("\nQuestion: what does this module do? Answer:",
                                     compress=False)],
    [Segment("The quick brown fox jumps over the lazy dog. " * 40),
     Segment("\nSummary:", compress=False)],
    [Segment(SOURCE[6000:9000]), Segment("\nExplain the code above:", compress=False)],
    [Segment("Tree: AB\n+CD\n++EF\n+GH\n++IJ\n+++KL\n" * 12),
     Segment("\nIs KL a child of IJ? Answer:", compress=False)],
]
NEW = 48


# the session's, like the engine's: a worker may run other modules' tests between this one's,
# and a module fixture would then be made again (a minute of torch answers each time)
@pytest.fixture(scope="session")
def torch_reader():
    return KTMModel.load("smollm2-135m-k4-seq")


@pytest.fixture(scope="session")
def torch_answers(torch_reader):
    return {merge: [torch_reader.generate(p, max_new_tokens=NEW, merge=merge) for p in PROMPTS]
            for merge in (True, False)}


@pytest.mark.parametrize("merge", [True, False])
def test_greedy_equals_torch_fp32_merged_and_plain(vllm_reader, torch_answers, merge):
    got = [vllm_reader.generate(p, max_new_tokens=NEW, merge=merge) for p in PROMPTS]
    assert got == torch_answers[merge]
    assert all(len(t) > 20 for t in got)  # real answers, not an early end
    # the prompts decoded together (vLLM batches them) give the same
    assert vllm_reader.generate(PROMPTS, max_new_tokens=NEW, merge=merge) == got


def test_streaming_gives_the_answer_piece_by_piece(vllm_reader, torch_answers):
    pieces = list(vllm_reader.stream(PROMPTS[0], max_new_tokens=NEW))
    assert len(pieces) > 5 and "".join(pieces) == torch_answers[True][0]


def test_scoring_reads_prompt_log_probs_as_torch_scores(vllm_reader, torch_reader):
    """``forward`` in eval mode (R, likelihood scoring, perplexity) on vLLM: the target's
    log-probs after the merged prefix, from vLLM's prompt log-probs."""
    targets = [" It decodes.", [5, 9, 17, 3], " yes", " no"]
    for merge in (True, False):
        want = torch_reader(PROMPTS, targets, merge=merge)
        got = vllm_reader(PROMPTS, targets, merge=merge)
        assert torch.equal(got.n_tokens, want.n_tokens) and got.tokens_out == want.tokens_out
        assert torch.allclose(got.nll, want.nll, rtol=1e-4, atol=1e-3)


def test_bad_rows_are_refused_and_the_engine_serves_on(vllm_reader, torch_answers):
    rt = vllm_reader.runtime
    good = vllm_reader.encode_prompts([PROMPTS[1]])[0]

    def prompt(embeds):
        return CompressedPrompt(embeds, good.tokens_in, embeds.shape[0])

    with pytest.raises(KTMError, match="576-wide input embeddings"):
        rt.prefill([prompt(torch.zeros(4, 100))])
    bad = good.embeds.clone()
    bad[3, 7] = float("nan")
    with pytest.raises(KTMError, match="NaN or inf"):
        rt.prefill([prompt(bad)])
    bad[3, 7] = float("inf")
    with pytest.raises(KTMError, match="NaN or inf"):
        rt.prefill([prompt(bad)])
    with pytest.raises(KTMError, match="vLLM refused the request"):  # past vLLM's context
        rt.prefill([prompt(torch.zeros(9000, 576))])
    # ktm's own check, before vLLM sees it: past the window even read at the deepest level
    # (a prompt within it is read at the ratio that fits, ktm.core.fit)
    with pytest.raises(KTMError, match="cannot fit the model's 8192 positions"):
        vllm_reader.generate([Segment("word " * 200000)], max_new_tokens=4)
    assert vllm_reader.generate(PROMPTS[1], max_new_tokens=NEW) == torch_answers[True][1]


# ---- ktm serve in front of vLLM -----------------------------------------------------------------

def _requests() -> list[dict]:
    """Eight greedy requests: completions and chats, merged documents and plain questions."""
    out = []
    for i, p in enumerate(PROMPTS * 2):
        doc, question = p[0].text[: 600 + 150 * i], p[1].text
        kw = {"model": "k4-seq", "max_tokens": 16 + 2 * i, "temperature": 0}
        if i % 2:
            kw["messages"] = [{"role": "user", "content": doc},
                              {"role": "user", "content": question, "ktm": {"merge": False}}]
        else:
            kw["prompt"] = None
            kw["extra_body"] = {"ktm": {"segments": [{"text": doc, "merge": True},
                                                     {"text": question, "merge": False}]}}
        out.append(kw)
    return out


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(url: str, kw: dict) -> str:
    if "messages" in kw:
        return _client(url).chat.completions.create(**kw).choices[0].message.content
    return _client(url).completions.create(**kw).choices[0].text


def _faults(url: str, reqs: list[dict]) -> None:
    """Streams dropped after their first chunk, and requests the server must refuse."""
    c = _client(url)
    for kw in reqs:  # ignoring EOS, each would run 40 steps: it ends by its client going
        extra = kw.get("extra_body", {})
        extra = {**extra, "ktm": {**extra.get("ktm", {}), "ignore_eos": True}}
        stream = (c.chat.completions if "messages" in kw else c.completions).create(
            **{**kw, "max_tokens": 40, "extra_body": extra}, stream=True)
        next(iter(stream))
        stream.close()
    bad = [dict(reqs[0], max_tokens=100000), dict(reqs[0], model="other"),
           dict(reqs[0], logprobs=2), dict(reqs[1], messages=[]),
           dict(reqs[0], extra_body={"ktm": {"segments": []}})]
    for kw in bad:
        with pytest.raises(openai.APIStatusError):
            _ask(url, kw)


def test_serve_answers_the_same_one_by_one_together_and_after_faults(vllm_reader, torch_reader):
    """Greedy output does not depend on the server's history or load: one at a time, then
    concurrently with dropped streams and bad requests, then one at a time again. Logprobs are
    refused: vLLM hands back tokens, not a distribution."""
    reqs = _requests()
    cfg = ServeConfig(model="smollm2-135m-k4-seq", served_name="k4-seq",
                      runtime=RuntimeSpec(backend="vllm"), batch_window_ms=100,
                      log_level="warning")
    app = create_app(vllm_reader, cfg)
    with BackgroundServer(app) as srv:
        before = [_ask(srv.url, kw) for kw in reqs]
        with ThreadPoolExecutor(len(reqs) + 1) as pool:
            noise = pool.submit(_faults, srv.url, reqs)
            together = list(pool.map(lambda kw: _ask(srv.url, kw), reqs))
            noise.result()
        after = [_ask(srv.url, kw) for kw in reqs]
        engine = app.state.engine
        assert engine.counts["peak_running"] >= 4  # they really were decoded together
        assert engine.counts["failed"] == 0
        assert engine.counts["cancelled"] == len(reqs), engine.counts  # each dropped stream
        assert engine.stats()["running"] == 0
    assert together == before and after == before
    # and the server equals the library on torch
    for kw, text in zip(reqs[::2], before[::2]):
        doc, q = (s["text"] for s in kw["extra_body"]["ktm"]["segments"])
        assert text == torch_reader.generate([Segment(doc), Segment(q, compress=False)],
                                             max_new_tokens=kw["max_tokens"])
    assert not vllm_reader.runtime._tokens  # every request, finished or dropped, was let go
