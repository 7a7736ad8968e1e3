"""Generated text reads as a continuation of the prompt: with SentencePiece (Llama 2, Mistral) the
first generated piece "▁fox" is " fox" after "... brown", as ``decode(prompt + generated)`` and
vLLM give, in ``generate``, ``stream`` and the server (streamed or not); byte-level BPE is
unchanged."""

import random

import openai
import pytest
import torch
from helpers import build_tokenizer, sentencepiece_like_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from ktm.core.prompt import Segment
from ktm.decode.generate import generate_ids
from ktm.decode.text_stream import TextStream
from ktm.model import KTMModel
from ktm.serving.app import BackgroundServer, create_app
from ktm.serving.config import ServeConfig

PROMPT = [Segment("The quick brown"), Segment(" fox", compress=False)]


def in_context(tok, prompt_ids, ids) -> str:
    """HF's reference: the text ``ids`` add to the decoded prompt."""
    head = tok.decode(prompt_ids, skip_special_tokens=True)
    return tok.decode(prompt_ids + ids, skip_special_tokens=True)[len(head):]


@pytest.fixture(scope="module")
def fox_dir(tmp_path_factory) -> str:
    """A saved tiny Llama with a SentencePiece-like tokenizer whose next token is always "▁fox":
    one embedding dimension, the same large value for every token, dominates the last hidden
    state, and only "▁fox" reads it."""
    tok = sentencepiece_like_tokenizer()
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      tie_word_embeddings=False))
    with torch.no_grad():
        lm.model.embed_tokens.weight[:, 0] = 100.0
        lm.lm_head.weight.zero_()
        lm.lm_head.weight[tok.convert_tokens_to_ids("\u2581fox"), 0] = 1.0
    path = tmp_path_factory.mktemp("fox")
    lm.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def fox_model(fox_dir):
    model = KTMModel.from_base(fox_dir, k=2)
    return model, model.tokenizer.convert_tokens_to_ids("\u2581fox")


def test_generate_and_stream_keep_the_first_pieces_space(fox_model):
    model, fox = fox_model
    ids = generate_ids(model, [PROMPT], max_new_tokens=4, stop_at_eos=False)[0]
    assert ids == [fox] * 4
    prompt_ids = model.tokenize("The quick brown", first=True) + model.tokenize(" fox")
    want = in_context(model.tokenizer, prompt_ids, ids)
    assert want == " fox fox fox fox"
    assert model.generate(PROMPT, max_new_tokens=4, stop_at_eos=False) == want
    assert "".join(model.stream(PROMPT, max_new_tokens=4, stop_at_eos=False)) == want


@pytest.mark.parametrize("stream", [False, True])
def test_ktm_generate_keeps_the_first_pieces_space(capsys, fox_dir, stream):
    from ktm.cli.main import main

    argv = ["generate", "--model", fox_dir, "--k", "2", "--prompt", "The quick brown",
            "--plain", " fox", "--max-new-tokens", "3"] + ["--stream"] * stream
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip("\n") == " fox fox fox"


def test_the_server_keeps_the_first_pieces_space_streamed_or_not(fox_model):
    model, _ = fox_model
    cfg = ServeConfig(model="fox", served_name="fox", max_tokens_limit=16,
                      batch_window_ms=10, log_level="warning")
    with BackgroundServer(create_app(model, cfg)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        kw = dict(model="fox", prompt="The quick brown fox", max_tokens=3, logprobs=1,
                  temperature=0, extra_body={"ktm": {"ignore_eos": True}})
        whole = client.completions.create(**kw).choices[0]
        chunks = list(client.completions.create(stream=True, **kw))
        chat = client.chat.completions.create(
            model="fox", max_tokens=3, temperature=0, messages=[{"role": "user", "content": "Hi"}],
            extra_body={"ktm": {"ignore_eos": True}}).choices[0]
    assert whole.text == " fox fox fox" == "".join(c.choices[0].text for c in chunks)
    assert whole.logprobs.text_offset == [0, 4, 8]
    assert whole.logprobs.tokens == [" fox"] * 3
    assert chat.message.content == " fox fox fox"


def test_byte_level_text_is_unchanged():
    # byte-level BPE decodes a continuation as it decodes the ids alone
    tok = build_tokenizer()
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(len(tok)) for _ in range(12)]
        ts = TextStream(tok)
        got = "".join(ts.push(i) for i in ids) + ts.flush()
        assert got == tok.decode(ids, skip_special_tokens=True)
