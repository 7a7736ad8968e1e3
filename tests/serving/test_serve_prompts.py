"""Requests -> segments: chat templates split around the contents, the ktm extension field."""

from types import SimpleNamespace

import pytest
from helpers import build_tokenizer

from ktm.core.tokens import SegmentTokenizer
from ktm.serving.prompts import chat_segments, completion_segments, context_of
from ktm.serving.protocol import ChatRequest, CompletionRequest, RequestError

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class Model:
    # an identity encoder: merging is skipped, so any ratio is readable
    # (``ktm.model.ratio_refusal``); no known context: any length is
    encoder = SimpleNamespace(config=SimpleNamespace(is_identity=True))
    max_positions = None

    def __init__(self, template=None, bos=False):
        self.tokenizer = build_tokenizer(bos)
        self.tokenizer.chat_template = template

    def tokenize(self, text, first=False):  # as KTMModel.tokenize
        return SegmentTokenizer(self.tokenizer)(text, first)


def chat(**kw):
    return ChatRequest(model="m", **kw)


def test_chat_template_text_is_plain_and_contents_keep_their_merge_flags():
    model = Model(TEMPLATE)
    msgs = [{"role": "system", "content": "The quick brown fox."},
            {"role": "user", "content": "Who? ", "ktm": {"merge": False}}]
    segs = chat_segments(model, chat(messages=msgs))
    assert [(s.text, s.compress) for s in segs] == [
        ("<|system|>", False), ("The quick brown fox.", True), ("<eos><|user|>", False),
        ("Who? ", False), ("<eos><|assistant|>", False)]
    rendered = model.tokenizer.apply_chat_template(msgs, tokenize=False,
                                                   add_generation_prompt=True)
    assert "".join(s.text for s in segs) == rendered
    assert all(list(s.ids) == model.tokenizer(s.text, add_special_tokens=False)["input_ids"]
               for s in segs)
    assert [s.text for s in context_of(segs)] == ["<|system|>", "The quick brown fox."]


def test_a_template_that_trims_the_contents_gets_them_trimmed():
    # Llama 3's template writes `message['content'] | trim`: the contents go back trimmed, so the
    # model reads what apply_chat_template gives, not a document's trailing blank lines
    model = Model(TEMPLATE.replace("m['content']", "m['content'] | trim"))
    msgs = [{"role": "system", "content": "\n The quick brown fox.\n\n"},
            {"role": "user", "content": " Who? ", "ktm": {"merge": False}}]
    segs = chat_segments(model, chat(messages=msgs))
    assert [(s.text, s.compress) for s in segs] == [
        ("<|system|>", False), ("The quick brown fox.", True), ("<eos><|user|>", False),
        ("Who?", False), ("<eos><|assistant|>", False)]
    rendered = model.tokenizer.apply_chat_template(msgs, tokenize=False,
                                                   add_generation_prompt=True)
    assert "".join(s.text for s in segs) == rendered
    parts = [{"text": " \n"}, {"text": " A document. "}, {"text": "Question? \n", "merge": False}]
    segs = chat_segments(model, chat(messages=[{"role": "user", "ktm": {"segments": parts}}]))
    assert [(s.text, s.compress) for s in segs][1:3] == [("A document. ", True),
                                                         ("Question?", False)]


def test_message_segments_and_top_level_merge_off():
    model = Model(TEMPLATE)
    parts = [{"text": "A long document. ", "merge": True}, {"text": "Question?", "merge": False}]
    msg = {"role": "user", "content": None, "ktm": {"segments": parts}}
    segs = chat_segments(model, chat(messages=[msg]))
    assert [(s.text, s.compress) for s in segs][1:3] == [("A long document. ", True),
                                                         ("Question?", False)]
    plain = chat_segments(model, chat(messages=[msg], ktm={"merge": False}))
    assert not any(s.compress for s in plain) and context_of(plain) == ()
    with pytest.raises(RequestError, match="messages.0.content"):
        chat_segments(model, chat(messages=[{**msg, "content": "something else"}]))


@pytest.mark.parametrize("template,role", [(TEMPLATE, "system"), (None, "system"),
                                           (TEMPLATE.replace("<|", "{# developer #}<|", 1),
                                            "developer")])
def test_the_developer_role_reads_as_system_where_the_template_does_not_know_it(template, role):
    model = Model(template)
    msgs = [{"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": "Hi"}]
    text = "".join(s.text for s in chat_segments(model, chat(messages=msgs)))
    expected = [{**msgs[0], "role": role}, msgs[1]]
    if template is None:
        assert text == f"{role}: Answer briefly.\nuser: Hi\nassistant:"
    else:
        assert text == model.tokenizer.apply_chat_template(expected, tokenize=False,
                                                           add_generation_prompt=True)


def test_without_a_template_roles_prefix_the_lines():
    segs = chat_segments(Model(), chat(messages=[{"role": "user", "content": "Hi there"}]))
    assert "".join(s.text for s in segs) == "user: Hi there\nassistant:"


def test_without_a_template_the_chat_opens_with_the_tokenizers_bos():
    """A template writes its own BOS; the role lines standing in for a missing one (a base
    Llama 3) get it once, first, as a completion's first segment does."""
    model = Model(bos=True)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = [i for s in chat_segments(model, chat(messages=msgs)) for i in s.ids]
    bos = model.tokenizer.bos_token_id
    assert ids[0] == bos and bos not in ids[1:]


def test_a_template_that_drops_a_message_is_refused():
    model = Model("{{ messages[-1]['content'] }}")
    with pytest.raises(RequestError, match="does not place each message"):
        chat_segments(model, chat(messages=[{"role": "system", "content": "a"},
                                            {"role": "user", "content": "b"}]))


def test_a_template_that_raises_on_the_roles_is_a_bad_request_not_a_crash():
    # Gemma's template refuses a system message, Llama 2's and Mistral's a user turn after a user
    # turn: the client gets a 400 with the template's own words, not a 500
    model = Model("{% if messages[0]['role'] == 'system' %}"
                  "{{ raise_exception('System role not supported') }}{% endif %}" + TEMPLATE)
    with pytest.raises(RequestError, match=r"refuses these messages \(roles \['system', "
                                           r"'user'\]\): System role not supported") as e:
        chat_segments(model, chat(messages=[{"role": "system", "content": "a"},
                                            {"role": "user", "content": "b"}]))
    assert e.value.param == "messages" and e.value.status == 400


def test_lone_surrogates_are_a_bad_request():
    with pytest.raises(RequestError, match=r"prompt is not valid Unicode: '\\ud800' at "
                                           r"character 6"):
        completion_segments(Model(), CompletionRequest(model="m", prompt="Hello \ud800 world"))
    with pytest.raises(RequestError, match="messages is not valid Unicode"):
        chat_segments(Model(TEMPLATE), chat(messages=[{"role": "user", "content": "\udfff"}]))


def test_completion_segments_follow_the_python_api():
    model = Model()
    req = CompletionRequest(model="m", prompt="Doc. Q?", ktm={"segments": [
        {"text": "Doc."}, {"text": "", "merge": False}, {"text": " Q?", "merge": False}]})
    (segs,) = completion_segments(model, req)
    assert [(s.text, s.compress) for s in segs] == [("Doc.", True), (" Q?", False)]
    assert list(segs[0].ids) == model.tokenize("Doc.", first=True)
    with pytest.raises(RequestError, match="prompt is empty"):
        completion_segments(model, CompletionRequest(model="m", prompt=""))


# Llama 2's chat layout: each turn opens with the BOS, an answer ends with the EOS; a content
# right after a special token, a template text right after one, a content after template text
SP_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ bos_token }}Review:"
               "{{ m['content'] }}{% elif m['role'] == 'user' %}{{ bos_token }}{{ m['content'] }}"
               ", Label:{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("kind", ["legacy", "prepend", "first"])
def test_a_sentencepiece_chat_reads_as_the_tokenizer_reads_the_rendered_template(kind):
    """A tokenizer that puts its dummy space before the text after every special token (a
    ``legacy=True`` Llama 2 / a Mistral ``tokenizer.json``) reads "<s>Review:" as "<s>",
    "▁Review:", as HF's ``apply_chat_template`` and vLLM do (and Meta's Llama 2 chat format:
    every turn "[INST]" encoded after the BOS with its dummy space). The template's text at the
    start of the chat and after a special token is read that way, not as a continuation."""
    from helpers import legacy_sentencepiece_tokenizers, sentencepiece_like_tokenizer

    model = Model()
    model.tokenizer = (sentencepiece_like_tokenizer() if kind == "first"
                       else legacy_sentencepiece_tokenizers()[kind])
    model.tokenizer.chat_template = SP_TEMPLATE
    msgs = [{"role": "system", "content": " These shoes fit well and look"},
            {"role": "user", "content": "my name is ktm"},
            {"role": "assistant", "content": " positive"},
            {"role": "user", "content": "These shoes fit"}]
    ids = [i for s in chat_segments(model, chat(messages=msgs)) for i in s.ids]
    tok = model.tokenizer
    want = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    assert tok.convert_ids_to_tokens(ids) == tok.convert_ids_to_tokens(list(want))


# the content follows template text that ends in whitespace: Llama 2's "[INST] " + content +
# " [/INST]" and " " + answer, Mistral's "[INST] " + content, ChatML's "<|im_start|>user\n"
JOIN_TEMPLATES = {
    "llama2": ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + "
               "m['content'].strip() + ' [/INST]' }}{% else %}{{ ' ' + m['content'].strip() + ' ' "
               "+ eos_token }}{% endif %}{% endfor %}"),
    "mistral": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}"
                "{{ m['content'] + eos_token }}{% endif %}{% endfor %}"),
    "chatml": ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
               "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|im_start|>assistant\n' }}{% endif %}"),
}


@pytest.mark.parametrize("template", sorted(JOIN_TEMPLATES))
@pytest.mark.parametrize("kind", ["byte-level", "first", "legacy", "prepend"])
def test_a_content_after_template_whitespace_reads_as_apply_chat_template_reads_it(kind,
                                                                                   template):
    """ "[INST] " + "Hello" reads "▁Hello" ("ĠHello"), as in the whole rendered text and in
    training, not "▁", "Hel", "lo": the template's trailing space joins the content, merged or
    plain; ChatML's "\\n" before a content stays in the template (it reads apart anyway)."""
    from helpers import legacy_sentencepiece_tokenizers, sentencepiece_like_tokenizer

    model = Model()
    model.tokenizer = {"byte-level": lambda: build_tokenizer(bos=True),
                       "first": sentencepiece_like_tokenizer,
                       }.get(kind, lambda: legacy_sentencepiece_tokenizers()[kind])()
    tok = model.tokenizer
    tok.chat_template = JOIN_TEMPLATES[template]
    msgs = [{"role": "user", "content": "Hello world"},
            {"role": "assistant", "content": "The quick brown fox"},
            {"role": "user", "content": "\n\nReview: These shoes", "ktm": {"merge": False}}]
    segs = chat_segments(model, chat(messages=msgs))
    ids = [i for s in segs for i in s.ids]
    plain = [{k: m[k] for k in ("role", "content")} for m in msgs]
    want = tok.apply_chat_template(plain, tokenize=True, return_dict=False,
                                   add_generation_prompt=True)
    assert tok.convert_ids_to_tokens(ids) == tok.convert_ids_to_tokens(list(want))
    contents = [(s.text, s.compress) for s in segs if s.text.strip() in
                ("Hello world", "The quick brown fox", "Review: These shoes")]
    assert [merge for _, merge in contents] == [True, True, False]
    if template == "chatml":
        assert contents[0][0] == "Hello world"


def test_a_ratio_reads_the_merged_parts_of_a_request_at_it():
    """ktm.ratio for a whole request (completions and chat), a segment's own ratio first; plain
    parts never carry one; a ratio below 1 or not finite is refused by the protocol."""
    from pydantic import ValidationError

    model = Model(TEMPLATE)
    req = CompletionRequest(model="m", prompt=None, ktm={
        "ratio": 3, "segments": [{"text": "The quick brown fox."}, {"text": " Q:", "merge": False},
                                 {"text": " The lazy dog.", "ratio": 1.5}]})
    [segs] = completion_segments(model, req)
    assert [(s.compress, s.ratio) for s in segs] == [(True, 3.0), (False, None), (True, 1.5)]
    [one] = completion_segments(model, CompletionRequest(model="m", prompt="The quick brown fox.",
                                                         ktm={"ratio": 2, "question": ""}))
    assert one[0].ratio == 2.0
    msgs = [{"role": "system", "content": "The quick brown fox."},
            {"role": "user", "content": "Who?", "ktm": {"merge": False}}]
    segs = chat_segments(model, chat(messages=msgs, ktm={"ratio": 4}))
    assert {(s.compress, s.ratio) for s in segs} == {(True, 4.0), (False, None)}
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", prompt="x", ktm={"ratio": bad})


def test_the_newest_user_messages_question_is_read_plain():
    from ktm.core.question import QUESTION_TOKENS, split_question

    model = Model(TEMPLATE)
    body = "".join(f"def f{i}(a, b):\n    return a + b\n" for i in range(40))
    asked = "Here is some code:\n" + body + "What does f7 return?"
    lead, merged, question = split_question(model, asked)
    assert (lead, question) == ("Here is some code:\n", "What does f7 return?")
    assert lead + merged + question == asked
    segs = chat_segments(model, chat(messages=[{"role": "user", "content": asked}]))
    assert [(s.text, s.compress, s.question) for s in segs
            if s.text in (lead, merged, question)] == [
        (lead, False, False), (merged, True, False), (question, False, True)]
    # a completion prompt of the same text is read by the same rule: its question marked
    [done] = completion_segments(model, CompletionRequest(model="m", prompt=asked))
    assert [(s.text, s.compress, s.question) for s in done] == [
        (lead, False, False), (merged, True, False), (question, False, True)]
    assert sum((s.ids for s in done), ()) == tuple(model.tokenize(asked, first=True))
    # ktm.question: the prompt merged whole, the question after it ("": none); not in a chat
    [marked] = completion_segments(model, CompletionRequest(
        model="m", prompt=lead + merged, ktm={"question": question}))
    assert [(s.text, s.compress, s.question) for s in marked] == [
        (lead + merged, True, False), (question, False, True)]
    # the KV the server may keep: the document before the question, merged or read plain
    assert context_of(marked) == marked[:1] and context_of(done) == done[:2]
    [plain] = completion_segments(model, CompletionRequest(
        model="m", prompt=asked, ktm={"question": question, "merge": False}))
    assert context_of(plain) == plain[:1] and not plain[0].compress
    [whole] = completion_segments(model, CompletionRequest(model="m", prompt=asked,
                                                           ktm={"question": ""}))
    assert [(s.text, s.compress) for s in whole] == [(asked, True)]
    with pytest.raises(RequestError, match="ktm.question is for /v1/completions") as e:
        chat_segments(model, chat(messages=[{"role": "user", "content": asked}],
                                  ktm={"question": question}))
    assert e.value.param == "ktm.question"
    segs = chat_segments(model, chat(messages=[{"role": "user", "content": asked}],
                                     ktm={"question": ""}))
    assert (asked, True) in [(s.text, s.compress) for s in segs]
    # a short message is its own question, read whole plain; an older one stays merged
    short = [{"role": "user", "content": "The quick brown fox."},
             {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Who?"}]
    segs = chat_segments(model, chat(messages=short))
    assert [(s.text, s.compress) for s in segs if s.text in ("Who?", "Yes.")] == [
        ("Yes.", True), ("Who?", False)]
    # a last line longer than the question's tokens: its last sentence
    line = "the quick brown fox jumps over the lazy dog " * (QUESTION_TOKENS // 4)
    _, merged, question = split_question(model, body + line + ". Who jumps?")
    assert question == "Who jumps?" and merged.endswith(". ")


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", [TEMPLATE, CHATML], ids=["tags", "chatml"])
def test_the_least_a_chat_takes_is_never_more_than_it_takes_and_refuses_a_long_one(
        tiny_model_dir, template):
    """``least_positions``, counted from the template's distinct pieces before the chat is read,
    is a lower bound of the positions the chat is read in; a chat whose bound passes the
    context is a 400 before its messages are read."""
    from helpers import fresh_model

    from ktm.serving.prompts import least_positions, render_chat

    model = fresh_model(tiny_model_dir, k=4)
    model.tokenizer.chat_template = template
    words = "the quick brown fox jumps over the lazy dog again".split()
    for n in (1, 2, 5, 12):
        msgs = [{"role": ("user", "assistant")[i % 2],
                 "content": " ".join(words[: 1 + (i * 3) % 9]) + (" " if i % 3 else "")}
                for i in range(n)]
        segs = chat_segments(model, chat(messages=msgs))
        layout, _ = render_chat(model.tokenizer, [(m["role"], i) for i, m in enumerate(msgs)])
        taken = model.encode_prompts([segs], embed=False)[0].tokens_out
        assert least_positions(model, layout, n) <= taken
    long = [{"role": "user", "content": "hi"}] * (model.max_positions // 2)
    with pytest.raises(RequestError, match="this chat takes at least") as e:
        chat_segments(model, chat(messages=long))
    assert e.value.param == "messages" and e.value.code == "context_length_exceeded"


def test_the_server_reads_with_the_quoting_it_is_given(tiny_model_dir):
    from ktm.serving.config import ServeConfig, load_served_model

    for quote in (None, "all"):
        model = load_served_model(ServeConfig(model=tiny_model_dir, quote=quote))
        assert model.config.quote == (quote or "far")
        assert model._prompt_encoder().quote == model.config.quote
