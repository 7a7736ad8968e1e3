"""The question allocator: a document's lines read plain where the question after it asks
about them (``ktm.core.relevance``), the least relevant left out where the ratio needs it."""

import dataclasses
import math
import warnings

import pytest
import torch
from helpers import fresh_model, perturb

from ktm import Segment
from ktm.core.allocate import RatioWarning, allocate, positions, spend
from ktm.core.prefix import LEFT_OUT
from ktm.core.relevance import lexical_scores, passages, word_of
from ktm.errors import KTMError

WORDS = {1: "alpha", 2: "beta", 3: "gamma", 4: None, 5: "delta", 9: "code"}


def word(t):
    return WORDS.get(t, f"w{t}")


def test_a_line_holding_the_questions_rare_words_scores_highest():
    nl = 4  # a line-break token (no word)
    doc = [10, 11, 12, nl, 13, 9, 14, nl, 15, 1, 2, nl, 16, 17, 18, nl, 19, 9, 20, nl]
    ends = {i for i, t in enumerate(doc) if t == nl}
    scores = lexical_scores(doc, [9, 1, 2], word, lambda i: i in ends)
    by_line = [scores[a] for a, _ in passages(doc, lambda i: i in ends)]
    # line 2 holds "alpha beta", side by side as asked: the best; the lines next to it get
    # half of it, those two away a quarter; line 4 holds only "code", in two lines of five
    # (its rare words are in line 2 alone: nothing flows from it)
    best = (1 + 1 + 0.5) * math.log(1 + 5 / 1)  # two words and the pair they make
    assert by_line[2] == pytest.approx(best) == max(by_line)
    assert by_line[1] == pytest.approx(0.5 * best) == by_line[3]
    assert by_line[0] == pytest.approx(0.25 * best)
    assert by_line[4] == pytest.approx(math.log(1 + 5 / 2))  # idf of "code"
    assert lexical_scores(doc, [4, 4], word, lambda i: i in ends) == [0.0] * len(doc)
    assert passages(list(range(70)), lambda i: False, longest=32) == [(0, 32), (32, 64),
                                                                       (64, 70)]


def test_feedback_follows_a_chain_of_assignments():
    lines = [["x", "=", "5", "7"], ["y", "=", "x"], ["q", "r", "s"], ["z", "=", "y"],
             ["t", "u", "v"], ["w", "o", "p"], ["k", "l", "m"]]
    vocab = {w: i + 10 for i, w in enumerate(sorted({w for ln in lines for w in ln} | {"nl"}))}
    doc = [t for ln in lines for t in [vocab[w] for w in ln] + [vocab["nl"]]]
    names = {i: w for w, i in vocab.items()}
    ends = {i for i, t in enumerate(doc) if names[t] == "nl"}
    scores = lexical_scores(doc, [vocab["5"], vocab["7"]],
                            lambda t: None if names[t] in ("nl", "=") else names[t],
                            lambda i: i in ends)
    by_line = [scores[a] for a, _ in passages(doc, lambda i: i in ends)]
    # "x" (from the line holding the value) finds "y = x", whose "y" finds "z = y"
    from ktm.core.relevance import DECAY

    assert by_line[1] == pytest.approx(DECAY * by_line[0])
    assert by_line[3] == pytest.approx(DECAY ** 2 * by_line[0])
    assert by_line[6] == 0  # three lines past the chain's last link


def test_word_of_reads_tokens_as_lowercase_words(tiny_model_dir):
    model = fresh_model(tiny_model_dir)
    w = word_of(model.tokenizer)
    ids = model.tokenize("The quick, brown fox.\n")
    words = [w(t) for t in ids]
    assert "".join(x for x in words if x) == "thequickbrownfox"
    assert None in words  # the comma, full stop and line break are no words


def test_the_scope_signal_reads_the_lines_opening_a_scored_lines_blocks(tiny_model_dir):
    """``scope``: a scored line's enclosing ``def`` and ``class`` get ``SCOPE`` of its score, a
    sibling function nothing more; text without indentation scores as ``question`` scores it."""
    from transformers import AutoTokenizer

    from ktm.core.signals import SCOPE, Scorer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    scorer = Scorer(tok)
    code = ("import os\n\nclass Loader:\n    def read_all(self, path):\n        data = []\n"
            "        for name in os.listdir(path):\n            data.append(parse_entry(name))\n"
            "        return data\n\n    def other(self):\n        return 1\n")
    ids = tok(code, add_special_tokens=False)["input_ids"]
    question = tok("which function is the line `data.append(parse_entry(name))` in?",
                   add_special_tokens=False)["input_ids"]
    plain, scoped = scorer("question", ids, question), scorer("scope", ids, question)

    def line(scores, text):  # the score of the line starting with ``text`` (its first token)
        at = len(tok(code[:code.index(text)], add_special_tokens=False)["input_ids"])
        return max(scores[at:at + 3])

    best = line(plain, "data.append")
    for header in ("class Loader", "def read_all", "for name"):
        assert line(scoped, header) >= SCOPE * best * 0.999 > line(plain, header)
    assert line(scoped, "def other") == line(plain, "def other")
    assert line(scoped, "data.append") == best
    prose = ("The fox ran.\nThe code for Kofi is 4521.\nThe dog slept.\n") * 3
    ids = tok(prose, add_special_tokens=False)["input_ids"]
    asked = tok("What is the code for Kofi?", add_special_tokens=False)["input_ids"]
    assert scorer("scope", ids, asked) == scorer("question", ids, asked)


def test_spend_leaves_out_the_least_relevant_to_read_the_wanted_plain():
    scores = [1e-6] * 14 + [5.0, 1e-6]  # 16 units of 4 tokens, unit 14 asked about
    levels = spend(scores, [4] * 16, (4, 2), budget=16, drop=True)
    assert levels[14] == 1  # read plain: 3 positions more than at K=4 ...
    assert levels.count(0) == 3  # ... paid for by three units left out
    assert sum(positions(4, lv) for lv in levels if lv) <= 16
    assert spend(scores, [4] * 16, (4, 2), budget=16) == [4] * 16  # no drop: as before
    # every unit at K fits with room for the wanted one: nothing left out
    assert 0 not in spend(scores, [4] * 16, (4, 2), budget=19, drop=True)


def test_the_question_signal_may_go_past_the_largest_level():
    ids = list(range(100, 356))
    scores = [0.0] * 256
    scores[100:108] = [3.0] * 8
    runs = allocate([ids], 0, 6.0, (4, 2), "question", scores)
    assert sum(n for n, _ in runs[0]) == 256
    read = sum(positions(n, lv) for n, lv in runs[0] if lv)
    assert read <= round(256 / 6)
    with pytest.raises(KTMError, match="ratio 6 is more than this reader allows"):
        allocate([ids], 0, 6.0, (4, 2), "even")


@pytest.fixture
def reader(tiny_model_dir):
    model = fresh_model(tiny_model_dir, k=4, inner_k=2, allocator="question")
    perturb(model)
    return model.eval()


DOC = "".join(f"line {i} says nothing much here\n" for i in range(12)) + \
    "the secret code is fox\n" + "".join(f"line {i} says nothing much\n" for i in range(12))


def _plain_tokens(model, prompt) -> list[str]:
    rows = model._prompt_encoder().layout([tuple(prompt)])[0]
    return [model.tokenizer.decode(ids) for ids, level, c in rows if c and level == 0 and ids]


def test_the_line_the_question_asks_about_is_read_plain(reader):
    asked = [Segment(DOC, ratio=3.0), Segment("\nWhat is the secret code? It is", compress=False)]
    assert "secret code is fox" in "".join(_plain_tokens(reader, asked))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RatioWarning)
        cp = reader.compress(asked)
    plain = len(reader.tokenize("\nWhat is the secret code? It is"))
    assert abs((cp.tokens_in - plain) / (cp.tokens_out - plain) / 3.0 - 1) <= 0.05
    # without a question the same segment is read evenly, as the even allocator reads it
    even = dataclasses.replace(reader._config, allocator="even")
    alone = reader.compress([Segment(DOC, ratio=3.0)])
    reader._config = even
    assert torch.equal(alone.embeds, reader.compress([Segment(DOC, ratio=3.0)]).embeds)


def test_past_the_largest_level_units_are_left_out_and_take_no_position(reader):
    asked = [Segment(DOC, ratio=6.0), Segment("\nWhat is the secret code?", compress=False)]
    rows = reader._prompt_encoder().layout([tuple(asked)])[0]
    out = sum(len(ids) for ids, level, _ in rows if level == LEFT_OUT)
    assert out > 0
    cp = reader.compress(asked)
    n_doc = len(reader.tokenize(DOC, True))
    plain = cp.tokens_in - n_doc
    assert cp.tokens_out - plain <= round(n_doc / 6.0) + 1
    assert cp.embeds.shape[0] == cp.tokens_out == cp.sources.shape[0]
    assert cp.merged_rows.shape[0] == cp.tokens_out
    # generation reads the shorter prompt like any other
    assert isinstance(reader.generate(asked, max_new_tokens=3), str)


def test_a_far_plain_line_is_quoted_after_the_document(reader, monkeypatch):
    import ktm.core.prefix as prefix

    asked = [Segment(DOC, ratio=3.0), Segment("\nWhat is the secret code? It is", compress=False)]
    near = reader._prompt_encoder().layout([tuple(asked)])[0]
    monkeypatch.setattr(prefix, "QUOTE_BEYOND", 8)  # every allocated plain line is far
    far = reader._prompt_encoder().layout([tuple(asked)])[0]
    assert sorted(map(str, near)) == sorted(map(str, far))  # the same pieces, moved
    doc = [p for p in far if p[2]]
    quoted = [j for j, (ids, level, _) in enumerate(doc) if level == 0 and ids]
    # the plain lines come last in the document, after every merged piece, in their order
    assert quoted == list(range(len(doc) - len(quoted), len(doc)))
    assert "secret code is fox" in reader.tokenizer.decode(
        [t for ids, _, _ in doc[quoted[0]:] for t in ids])
    assert far[-1] == near[-1]  # the question stays last
    cp = reader.compress(asked)
    assert cp.tokens_out == reader.encode_prompts([asked], embed=False)[0].tokens_out


def test_without_a_question_the_question_allocator_at_k_reads_as_even_does(reader):
    """At ratio K (the question reader's default) a prompt without a question is read as the
    even allocator reads it, in uniform K's positions: nothing left out to a ratio's
    rounding."""
    ids = tuple(range(10, 10 + 4 * 12 + 1))  # 49 tokens: 13 units at K=4, round(49 / 4) = 12
    reader._config = dataclasses.replace(reader._config, ratio=4.0)
    alone = reader.compress([Segment("", ids=ids)])
    reader._config = dataclasses.replace(reader._config, allocator="even")
    even = reader.compress([Segment("", ids=ids)])
    reader._config = dataclasses.replace(reader._config, ratio=None)
    assert alone.tokens_out == even.tokens_out == reader.compress(
        [Segment("", ids=ids)]).tokens_out == 13
    assert torch.equal(alone.embeds, even.embeds)


def test_the_wanted_units_are_refined_first_a_lines_short_last_unit_too():
    # a wanted line of 4 + 4 + 3 tokens, then a context line worth half of it per token
    scores, lengths = [4.0, 4.0, 3.0, 1.8, 1.8], [4, 4, 3, 4, 4]
    levels = spend(scores, lengths, (4, 2), budget=5 + 8, drop=True)
    assert levels[:3] == [1, 1, 1] and levels[3:] == [4, 4]


def test_relevance_does_not_flow_along_the_questions_own_words():
    nl = 4
    # "code" (asked) is rare, in lines 0 and 2; line 0 also holds the rare asked name "alpha"
    doc = [1, 9, nl, 11, 12, nl, 9, 13, nl, 14, 15, nl]
    ends = {i for i, t in enumerate(doc) if t == nl}
    scores = lexical_scores(doc, [1, 9], word, lambda i: i in ends)
    by_line = [scores[a] for a, _ in passages(doc, lambda i: i in ends)]
    assert by_line[2] == pytest.approx(math.log(1 + 4 / 2))  # its own "code", nothing flowed


def test_a_marked_question_is_the_question_and_read_plain(reader):
    from ktm.core.question import asking, question_segments, question_text

    doc, q, cue = Segment(DOC), Segment("\nWhat is the secret code?", question=True), \
        Segment(" It is", compress=False)
    assert q.compress is False and asking(DOC, q.text) == (doc, q)
    with pytest.raises(KTMError, match="question Segment is read plain"):
        Segment("Who?", question=True, ratio=2.0)
    # unmarked: the plain segments after the last compressed one; marked: only those marked
    unmarked = (doc, Segment(q.text, compress=False), cue)
    assert question_segments(unmarked) == [1, 2] and question_segments((doc,)) == []
    assert question_segments((doc, q, cue)) == [1] and question_text((doc, q, cue)) == q.text
    # the allocator reads the document with the marked question alone in view: the answer cue
    # after it is no part of it (unmarked, the cue's words would be asked too)
    seen = []
    scorer = reader.scorer
    reader.scorer = lambda name, ids, question: seen.append(list(question)) or scorer(
        name, ids, question)
    marked = reader.encode_prompts([(replace_ratio(doc), q, cue)], embed=False)[0]
    alone = reader.encode_prompts([(replace_ratio(doc), q)], embed=False)[0]
    assert seen[0] == seen[1] == reader.tokenize(q.text)
    assert marked.tokens_out == alone.tokens_out + len(reader.tokenize(cue.text))


def replace_ratio(seg):
    return dataclasses.replace(seg, ratio=3.0)


def test_quote_all_reads_the_document_the_same_whatever_is_asked(reader):
    """``quote="all"``: the document read as without a question, the lines each question picks
    copied after it, then the question: the document's rows (and so its KV) are shared."""
    reader._config = dataclasses.replace(reader._config, quote="all")
    asks = ["\nWhat is the secret code?", "\nWhat does line 3 say?"]
    rows = [reader._prompt_encoder().layout([(Segment(DOC, ratio=3.0),
                                              Segment(q, question=True))])[0] for q in asks]
    alone = reader._prompt_encoder().layout([(Segment(DOC, ratio=3.0),)])[0]
    for row, q in zip(rows, asks):
        assert row[:len(alone)] == alone  # the document as read without a question
        assert all(level == 0 for _, level, _ in row[len(alone):])
        assert row[-1][0] == reader.tokenize(q)
    assert "secret code is fox" in reader.tokenizer.decode(
        [t for ids, _, _ in rows[0][len(alone):-1] for t in ids])
    cps = [reader.compress([Segment(DOC, ratio=3.0), Segment(q, question=True)]) for q in asks]
    from ktm.core.prefix import rows_of

    n = sum(rows_of(ids, level) for ids, level, _ in alone)
    assert n > 0 and torch.equal(cps[0].embeds[:n], cps[1].embeds[:n])
    assert not torch.equal(cps[0].embeds[n:n + 3], cps[1].embeds[n:n + 3])
