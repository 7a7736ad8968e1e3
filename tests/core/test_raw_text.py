"""Raw training text reads a special token's string as text; a prompt may carry one as a token."""

import pytest
from helpers import build_tokenizer
from tokenizers import AddedToken

from ktm import KTMError
from ktm.core.tokens import SegmentTokenizer
from ktm.tasks.corpus import tokenize_docs

CODE = 'if tok == "<eos>": return "<pad>"  # the end of the quick brown fox'


def test_a_special_tokens_string_in_a_corpus_text_is_plain_text():
    tok = build_tokenizer()
    (doc,) = tokenize_docs(tok, [CODE], min_tokens=2)
    assert not {tok.eos_token_id, tok.pad_token_id} & set(doc.tolist())
    assert tok.decode(doc.tolist()) == CODE
    # the tokenizer is left as it was: its Rust tokenizer, used directly, still reads the token
    assert tok.eos_token_id in tok.backend_tokenizer.encode("a <eos>").ids
    # text without such a string tokenizes as before
    plain = "the quick brown fox jumps over the lazy dog"
    (doc,) = tokenize_docs(tok, [plain], min_tokens=2)
    assert doc.tolist() == tok(plain, add_special_tokens=False)["input_ids"]


def test_a_prompt_keeps_a_chat_templates_markers_as_tokens():
    tok = build_tokenizer()
    assert tok.eos_token_id in SegmentTokenizer(tok)("Hello<eos>", first=True)


class NoSplitTokenizer:
    """A tokenizer that refuses ``split_special_tokens``, as mistral-common's does."""

    def __init__(self):
        self.inner = build_tokenizer()
        # a special added token outside all_special_ids, as SmolLM2's "<filename>" is
        self.inner.add_tokens([AddedToken("<filename>", special=True)])
        self.added_tokens_decoder = self.inner.added_tokens_decoder
        self.all_special_ids, self.unk_token_id = self.inner.all_special_ids, None
        self.convert_ids_to_tokens = self.inner.convert_ids_to_tokens

    def __call__(self, texts, split_special_tokens=False, **kw):
        if split_special_tokens:
            raise ValueError("does not support `split_special_tokens`")
        return self.inner(texts, **kw)


def test_a_tokenizer_that_cannot_split_special_tokens_refuses_only_texts_holding_one():
    from ktm.core.tokens import raw_text_ids

    tok = NoSplitTokenizer()
    plain = "the quick brown fox"
    assert raw_text_ids(tok, [plain]) == [tok.inner(plain, add_special_tokens=False)["input_ids"]]
    with pytest.raises(KTMError, match="'<eos>'.*split_special_tokens"):
        raw_text_ids(tok, [CODE])
    assert "<filename>" not in tok.inner.all_special_tokens
    with pytest.raises(KTMError, match="'<filename>'"):
        raw_text_ids(tok, ["a <filename> b"])
