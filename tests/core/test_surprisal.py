"""The n-gram surprisal table of adaptive merging: counts, scores, the file it ships as."""

import math

import pytest
import torch

from ktm.core.surprisal import BUCKETS, SurprisalTable
from ktm.errors import KTMError


def test_a_frequent_bigram_is_less_surprising_than_a_rare_one():
    docs = [[1, 2, 3, 1, 2, 4, 1, 2, 3]] * 20 + [[5, 6]]
    table = SurprisalTable.count(docs, vocab=10)
    after_one = table.scores([1, 2, 7], prev=None)
    assert after_one[1] < 0.5  # "2" after "1": seen 60 times in 60
    assert after_one[2] > 8  # "7" after "2": never seen, and unseen alone too
    # the first token with no previous one: its unigram surprisal, add-one smoothed
    p1 = (60 + 1) / (sum(len(d) for d in docs) + 10)
    assert after_one[0] == pytest.approx(-math.log2(p1))
    assert table.scores([]) == []


def test_the_table_round_trips_and_refuses_other_files(tmp_path):
    table = SurprisalTable.count([[0, 1, 2, 1, 0]], vocab=4)
    table.save(tmp_path / "t.safetensors")
    again = SurprisalTable.load(tmp_path / "t.safetensors")
    assert again.scores([0, 1, 2]) == table.scores([0, 1, 2])
    assert again.bigram.shape == (BUCKETS,)
    (tmp_path / "bad.safetensors").write_bytes(b"not a table")
    with pytest.raises(KTMError, match="cannot read surprisal table"):
        SurprisalTable.load(tmp_path / "bad.safetensors")
    with pytest.raises(KTMError, match="outside this surprisal table's vocabulary of 4"):
        table.scores([1, 9])
    with pytest.raises(KTMError, match="outside the vocabulary of 4"):
        SurprisalTable.count([[5]], vocab=4)
    with pytest.raises(KTMError, match="holds a \\(vocab,\\) unigram"):
        SurprisalTable(torch.zeros(4), torch.zeros(3))
