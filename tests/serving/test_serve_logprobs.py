"""``ktm serve`` logprobs: equal to the model's own log-softmax, streamed as returned, free for the
requests that do not ask (tiny in-process model, official openai client)."""

import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from test_serve import DOC, openai_client, running_server

from ktm.core.loss import target_logits
from ktm.decode.generate import generate_ids
from ktm.serving.prompts import chat_segments
from ktm.serving.protocol import ChatRequest

MESSAGES = [{"role": "system", "content": DOC},
            {"role": "user", "content": "Who?", "ktm": {"merge": False}}]
# every choice has max_tokens tokens, as the reference; a completion prompt merged whole, as the
# reference reads it (CHAT_NO_EOS: a chat read as chat_prompt reads it)
CHAT_NO_EOS = {"ktm": {"ignore_eos": True}}
NO_EOS = {"ktm": {**CHAT_NO_EOS["ktm"], "question": ""}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir, 64) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai_client(server)


def reference(model, prompt, n: int, **sampling) -> tuple[list[int], torch.Tensor]:
    """The library's tokens for ``prompt`` and the log-softmax (n, V) of the logits predicting
    each, from one plain forward over the prompt and those tokens (no KV cache)."""
    ids = generate_ids(model, [prompt], max_new_tokens=n, stop_at_eos=False, **sampling)[0]
    with torch.no_grad():
        logits = target_logits(model.eval(), [prompt], [ids]).logits
    return ids, torch.log_softmax(logits, dim=-1)


def chat_prompt(model, messages):
    return chat_segments(model, ChatRequest(model="tiny", messages=messages))


SAMPLING = {"greedy": ({"temperature": 0}, {}),
            "sampled": ({"temperature": 0.9, "top_p": 0.8, "seed": 3},
                        {"do_sample": True, "temperature": 0.9, "top_p": 0.8, "seed": 3})}


@pytest.mark.parametrize("top", [0, 3, 5])
@pytest.mark.parametrize("how", SAMPLING)
def test_completion_logprobs_are_the_models_log_softmax(server, client, how, top):
    # with temperature and top-p too, the logprobs are of the model's raw distribution (vLLM's
    # default), which the reference computes without either
    request, library = SAMPLING[how]
    r = client.completions.create(model="tiny", prompt=DOC, max_tokens=12, logprobs=top,
                                  extra_body=NO_EOS, **request).choices[0]
    ids, ref = reference(server.model, DOC, 12, **library)
    tok = server.model.tokenizer
    lp = r.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs == pytest.approx([float(ref[j, t]) for j, t in enumerate(ids)],
                                              abs=1e-4)
    # a token that continues a character (a byte of it) starts where that character starts
    assert lp.text_offset == [len(tok.decode(ids[:j]).rstrip("\ufffd")) for j in range(len(ids))]
    assert tok.decode(ids) == r.text
    for j, (t, top_j) in enumerate(zip(ids, lp.top_logprobs)):
        # the N most likely and the sampled one, most likely first; keys are texts, and two
        # tokens may read the same (bytes of one character): the sampled one's value wins, else
        # the more likely one's
        values, best = ref[j].topk(top)
        expected: dict[str, float] = {}
        for b, v in zip(best.tolist(), values.tolist()):
            expected.setdefault(tok.decode([b]), v)
        expected[tok.decode([t])] = float(ref[j, t])
        assert set(top_j) == set(expected)
        assert top_j == pytest.approx(expected, abs=1e-4)
        assert list(top_j.values()) == sorted(top_j.values(), reverse=True)
        assert top_j[lp.tokens[j]] == lp.token_logprobs[j]
    if how == "greedy":
        assert all(list(t)[0] == s for t, s in zip(lp.top_logprobs, lp.tokens))
    assert top == 0 or max(len(t) for t in lp.top_logprobs) > 1


def test_chat_logprobs_are_the_models_log_softmax(server, client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10,
                                       temperature=1.0, seed=5, logprobs=True, top_logprobs=4,
                                       extra_body=CHAT_NO_EOS).choices[0]
    prompt = chat_prompt(server.model, MESSAGES)
    ids, ref = reference(server.model, prompt, 10, do_sample=True, seed=5)
    tok = server.model.tokenizer
    content = r.logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in ids]
    assert tok.decode(ids) == r.message.content
    # each token's own bytes, also where its text reads "\ufffd" (a byte of a character)
    assert bytes(b for c in content for b in c.bytes).decode(errors="replace") == r.message.content
    assert any("\ufffd" in c.token for c in content)
    for j, (t, c) in enumerate(zip(ids, content)):
        assert c.logprob == pytest.approx(float(ref[j, t]), abs=1e-4)
        values, best = ref[j].topk(4)
        assert [a.token for a in c.top_logprobs] == [tok.decode([int(b)]) for b in best]
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert [a.logprob for a in c.top_logprobs] == sorted(
            (a.logprob for a in c.top_logprobs), reverse=True)
        assert all(a.logprob == c.logprob for a in c.top_logprobs if a.bytes == c.bytes)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                           logprobs=True, temperature=0)
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)


def _joined_completion(chunks, n: int) -> list[dict]:
    out = [{"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [],
            "text_offset": []} for _ in range(n)]
    for ch in chunks:
        (c,) = ch.choices
        out[c.index]["text"] += c.text
        if c.logprobs is not None:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                out[c.index][key] += getattr(c.logprobs, key)
    return out


def test_streamed_completion_logprobs_join_to_the_non_streaming_ones(client):
    # two prompts, two choices each, a stop string: each chunk carries its tokens' logprobs
    kw = dict(model="tiny", prompt=[DOC, "Hello world"], n=2, max_tokens=16, temperature=1.0,
              seed=11, logprobs=2, stop=["e"])
    whole = client.completions.create(**kw)
    streamed = _joined_completion(client.completions.create(stream=True, **kw), 4)
    assert [s["text"] for s in streamed] == [c.text for c in whole.choices]
    for s, c in zip(streamed, whole.choices):
        assert {k: v for k, v in s.items() if k != "text"} == c.logprobs.model_dump()
    assert sum(len(c.logprobs.tokens) for c in whole.choices) > 4


def test_streamed_chat_logprobs_join_to_the_non_streaming_ones(client):
    kw = dict(model="tiny", messages=MESSAGES, n=2, max_tokens=16, temperature=1.0, seed=2,
              logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    content = [[], []]
    for ch in client.chat.completions.create(stream=True, **kw):
        (c,) = ch.choices
        if c.logprobs is not None:
            content[c.index] += c.logprobs.content
    assert content == [c.logprobs.content for c in whole.choices]
    assert all(len(x) > 1 for x in content)


def test_a_stop_string_inside_a_token_keeps_that_token_and_drops_the_rest(server, client):
    # the returned text is a prefix of the tokens' texts joined: the token the stop string
    # starts in is kept (part of its text is returned), the tokens after it are dropped
    kw = dict(model="tiny", prompt=DOC, max_tokens=24, temperature=0, logprobs=1,
              extra_body=NO_EOS)
    full = client.completions.create(**kw).choices[0]
    tokens, offsets = full.logprobs.tokens, full.logprobs.text_offset
    j = next(j for j, t in enumerate(tokens) if j > 1 and len(t.strip()) >= 2
             and tokens[j - 1].strip())
    cut = offsets[j] + len(t := tokens[j]) - len(t.lstrip()) + 1  # after its first character
    stop = full.text[cut:cut + 3]
    assert stop and full.text.find(stop) == cut, (full.text, stop)
    for stream in (False, True):
        r = client.completions.create(stop=[stop], stream=stream, **kw)
        if stream:
            (got,) = _joined_completion(r, 1)
        else:
            c = r.choices[0]
            got = {"text": c.text, **c.logprobs.model_dump()}
        assert got["text"] == full.text[:cut]
        assert got["tokens"] == tokens[:j + 1]
        assert got["token_logprobs"] == full.logprobs.token_logprobs[:j + 1]


def _ask(url: str, kw: dict):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    if "messages" in kw:
        ch = c.chat.completions.create(**kw).choices[0]
        lp = ch.logprobs and ([x.token for x in ch.logprobs.content],
                              [x.logprob for x in ch.logprobs.content])
        return ch.message.content, lp
    ch = c.completions.create(**kw).choices[0]
    return ch.text, ch.logprobs and (ch.logprobs.tokens, ch.logprobs.token_logprobs)


def test_a_batch_with_and_without_logprobs_gives_each_the_answer_it_gets_alone(server):
    reqs = []
    for i in range(8):
        kw = {"model": "tiny", "max_tokens": 6 + i, "temperature": 0 if i % 3 else 0.8,
              "seed": i}
        if i % 2:
            kw["messages"] = [{"role": "user", "content": DOC[i:]}]
            kw |= {"logprobs": True, "top_logprobs": i % 4} if i % 4 == 1 else {}
        else:
            kw["prompt"] = DOC[i:]
            kw |= {"logprobs": i % 6} if i % 4 == 0 else {}
        reqs.append(kw)
    alone = [_ask(server.url, kw) for kw in reqs]
    # the high-water mark from here on: an earlier test of this module's server may have set it
    server.engine.counts["peak_running"] = 0
    start = threading.Barrier(len(reqs))

    def together(kw):
        start.wait()
        return _ask(server.url, kw)

    with ThreadPoolExecutor(len(reqs)) as pool:
        batched = list(pool.map(together, reqs))
    assert server.engine.counts["peak_running"] >= 4  # they really were decoded together
    assert [t for t, _ in batched] == [t for t, _ in alone]
    for (_, a), (_, b) in zip(alone, batched):
        assert (a is None) == (b is None)
        if a is not None:
            assert a[0] == b[0] and a[1] == pytest.approx(b[1], abs=1e-4)
    assert sum(lp is None for _, lp in alone) == 4


def _refused(server, body: dict, path: str) -> dict:
    req = urllib.request.Request(server.url + path, data=json.dumps({"model": "tiny",
                                                                     **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
    return json.loads(e.value.read())["error"]


BAD = [
    ({"prompt": "hi", "logprobs": 6}, "/v1/completions", "logprobs",
     "logprobs: Input should be less than or equal to 5, got 6"),
    ({"prompt": "hi", "logprobs": -1}, "/v1/completions", "logprobs",
     "logprobs: Input should be greater than or equal to 0, got -1"),
    ({"prompt": "hi", "logprobs": True}, "/v1/completions", "logprobs",
     "logprobs: Input should be a valid integer, got true"),
    ({"prompt": "hi", "echo": True}, "/v1/completions", "echo",
     "echo=true is not supported by this server: the prompt is merged"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "/v1/chat/completions", "top_logprobs",
     "top_logprobs: Input should be less than or equal to 20, got 21"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "/v1/chat/completions", "top_logprobs", "top_logprobs=2 needs logprobs=true"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1},
     "/v1/chat/completions", "logprobs", "logprobs: Input should be a valid boolean, got 1"),
]


@pytest.mark.parametrize("body,path,param,message", BAD, ids=[b[3][:40] for b in BAD])
def test_out_of_range_logprobs_are_400s_naming_the_field(server, body, path, param, message):
    err = _refused(server, body, path)
    assert message in err["message"], err
    assert err["param"] == param


def test_requests_without_logprobs_compute_none(server, client, monkeypatch):
    # log_softmax runs only for the rows that asked: a step of rows that did not never calls it
    import inspect

    g = next(f for f in vars(type(server.engine)).values() if inspect.isfunction(f)).__globals__
    calls = []
    step_logprobs = g["step_logprobs"]
    monkeypatch.setitem(g, "step_logprobs", lambda *a: calls.append(a[2]) or step_logprobs(*a))
    r = client.completions.create(model="tiny", prompt=DOC, max_tokens=5, extra_body=NO_EOS)
    assert r.choices[0].logprobs is None and calls == []
    client.completions.create(model="tiny", prompt=DOC, max_tokens=5, logprobs=0,
                              extra_body=NO_EOS)
    assert calls == [[0]] * 5


def test_a_token_reads_with_its_space_also_for_sentencepiece():
    # decoded alone, SentencePiece's "▁quick" reads "quick": the tokens would join without spaces
    from helpers import build_tokenizer, sentencepiece_like_tokenizer

    from ktm.serving.logprobs import token_text

    for tok in (sentencepiece_like_tokenizer(), build_tokenizer()):
        ids = tok("The quick brown fox", add_special_tokens=False)["input_ids"]
        assert "".join(token_text(tok, i) for i in ids[1:]) == " quick brown fox"


def _offsets_by_whole_decoding(tok, ids) -> list[int]:
    """The definition: characters of the continuation's text before each token, an unfinished
    character left out."""
    from ktm.decode.text_stream import decode_continuation

    return [len(decode_continuation(tok, ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]


def test_trail_offsets_are_incremental_and_equal_the_whole_decodings(ktm_model):
    """Each token decoded every token before it again (O(n^2) over a generation); the offsets
    now come from the tokens after the last settled point, and are the same."""
    import random

    from helpers import byte_fallback_tokenizer, sentencepiece_like_tokenizer

    from ktm.serving.logprobs import Trail

    def offsets(tok, ids):
        trail = Trail(tok)
        for i in ids:
            trail.add(i, 0.0, ())
        return [e.offset for e in trail.waiting]

    model = ktm_model
    generated = generate_ids(model, [DOC], max_new_tokens=120, stop_at_eos=False,
                             do_sample=True, seed=5)[0]
    assert offsets(model.tokenizer, generated) == _offsets_by_whole_decoding(
        model.tokenizer, generated)
    rng = random.Random(0)
    for tok in (byte_fallback_tokenizer(), sentencepiece_like_tokenizer(), model.tokenizer):
        ids = [rng.randrange(len(tok)) for _ in range(300)]
        if len(tok) == 258:  # mostly bytes, from short characters to broken ones
            ids = [i for b in "ok €東\n".encode() * 20 for i in (1 + b, 257)[:rng.randint(1, 2)]]
            ids += [rng.randrange(len(tok)) for _ in range(200)]
        assert offsets(tok, ids) == _offsets_by_whole_decoding(tok, ids)
        tok.clean_up_tokenization_spaces = True  # nothing settles: still the same offsets
        assert offsets(tok, ids[:60]) == _offsets_by_whole_decoding(tok, ids[:60])
        tok.clean_up_tokenization_spaces = False
    tok = sentencepiece_like_tokenizer()
    decoded, decode = [], tok.decode
    tok.decode = lambda ids, **kw: decoded.append(len(ids)) or decode(ids, **kw)
    offsets(tok, tok.encode("The quick brown fox " * 50, add_special_tokens=False))
    assert max(decoded) <= 3  # the anchor, a settled token, the new one


def test_nan_logits_give_the_floor_not_a_500(server, monkeypatch):
    """log_softmax of a row whose logits went NaN is NaN: the response failed to encode (500;
    a stream sent the invalid JSON ``NaN``). NaN reads as OpenAI's -inf stand-in, -9999."""
    import inspect

    g = next(f for f in vars(type(server.engine)).values() if inspect.isfunction(f)).__globals__
    step_logprobs = g["step_logprobs"]
    monkeypatch.setitem(g, "step_logprobs", lambda logits, *a: step_logprobs(
        torch.full_like(logits, float("nan")), *a))
    for path, body in [("/v1/completions", {"prompt": DOC, "logprobs": 2}),
                       ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True,
                                                 "top_logprobs": 2})]:
        for stream in (False, True):
            req = urllib.request.Request(
                server.url + path, headers={"Content-Type": "application/json"},
                data=json.dumps({"model": "tiny", "max_tokens": 3, "stream": stream, **CHAT_NO_EOS,
                                 **body}).encode())
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read().decode()
            assert "NaN" not in raw and "-9999" in raw
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    lp = c.completions.create(model="tiny", prompt=DOC, max_tokens=3, logprobs=2,
                              extra_body=NO_EOS).choices[0].logprobs
    assert lp.token_logprobs == [-9999.0] * 3
    assert all(set(t.values()) == {-9999.0} for t in lp.top_logprobs)
