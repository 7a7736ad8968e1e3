import pytest
import torch

from ktm import KTMError
from ktm.core.encoder import KTokenEncoder


def masked_mean_reference(x, mask, k):
    b, t, d = x.shape
    n = -(-t // k)
    out = torch.zeros(b, n, d)
    out_mask = torch.zeros(b, n, dtype=torch.bool)
    for i in range(b):
        for j in range(n):
            rows = [x[i, p] for p in range(j * k, min(t, j * k + k)) if mask[i, p]]
            if rows:
                out[i, j] = torch.stack(rows).mean(0)
                out_mask[i, j] = True
    return out, out_mask


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("t", [1, 7, 12])
def test_untrained_encoder_is_masked_mean(k, t):
    torch.manual_seed(k * 100 + t)
    enc = KTokenEncoder(16, k)
    x = torch.randn(3, t, 16)
    lengths = [t, max(1, t - 3), max(1, t // 2)]
    mask = torch.tensor([[p < n for p in range(t)] for n in lengths])
    out, out_mask = enc(x, mask)
    ref, ref_mask = masked_mean_reference(x, mask, k)
    assert out.shape == (3, -(-t // k), 16)
    assert torch.equal(out_mask, ref_mask)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_block_of_padding_only_is_masked_and_zero():
    enc = KTokenEncoder(8, 2)
    x = torch.randn(2, 6, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    out, out_mask = enc(x, mask)
    assert out_mask.tolist() == [[True, True, True], [True, False, False]]
    assert torch.all(out[1, 1:] == 0)


def test_trained_mlp_result_independent_of_batch_mates_and_padding():
    torch.manual_seed(0)
    enc = KTokenEncoder(8, 3)
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.3)
    a = torch.randn(1, 7, 8)
    b = torch.randn(1, 11, 8) * 5
    alone, _ = enc(a)
    batch = torch.zeros(2, 11, 8)
    batch[0, :7], batch[1] = a[0], b[0]
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[0, :7], mask[1] = True, True
    together, _ = enc(batch, mask)
    torch.testing.assert_close(together[0, :3], alone[0], atol=1e-5, rtol=1e-5)
    # garbage in padded slots must not leak into the partial last block
    batch2 = batch.clone()
    batch2[0, 7:] = 100.0
    again, _ = enc(batch2, mask)
    torch.testing.assert_close(again[0, :3], alone[0], atol=1e-5, rtol=1e-5)


def test_mlp_changes_output_once_trained():
    enc = KTokenEncoder(8, 2)
    x = torch.randn(1, 4, 8)
    before, _ = enc(x)
    torch.nn.init.normal_(enc.mlp[-1].weight, std=0.5)
    after, _ = enc(x)
    assert not torch.allclose(before, after)


def test_mean_pool_ablation_has_no_parameters():
    enc = KTokenEncoder(8, 4, use_mlp=False)
    assert sum(p.numel() for p in enc.parameters()) == 0


@pytest.mark.parametrize("k", [0, -1, 2.5])
def test_bad_k_is_a_clear_error(k):
    with pytest.raises(KTMError, match="k must be an integer >= 1"):
        KTokenEncoder(8, k)


def test_bad_shape_is_a_clear_error():
    enc = KTokenEncoder(8, 2)
    with pytest.raises(KTMError, match=r"\(B, T, 8\)"):
        enc(torch.randn(2, 5, 7))


def test_recursive_encoder_starts_as_the_mean_and_counts_blocks():
    from ktm.core.encoder import EncoderConfig

    torch.manual_seed(0)
    enc = KTokenEncoder.from_config(EncoderConfig(8, k=4, inner_k=2, slot_weights=True))
    x = torch.randn(2, 8, 8)
    out, mask = enc(x)
    assert out.shape == (2, 2, 8) and mask.all()
    torch.testing.assert_close(out, x.view(2, 2, 4, 8).mean(2))
    with torch.no_grad():
        enc.inner.slots[0].mul_(3.0)  # order matters at the inner level once trained
    swapped = x.clone()
    swapped[:, [0, 1]] = swapped[:, [1, 0]]
    assert not torch.allclose(enc(x)[0][:, 0], enc(swapped)[0][:, 0])
    with pytest.raises(KTMError, match="inner_k=3 must divide k=4"):
        EncoderConfig(8, k=4, inner_k=3)


def test_k2_reader_starts_the_inner_level_of_a_recursive_k4(tiny_model_dir, tmp_path):
    from ktm.core.checkpoint import load_adapter_into
    from ktm.model import KTMModel

    torch.manual_seed(0)
    k2 = KTMModel.from_base(tiny_model_dir, k=2, slot_weights=True)
    with torch.no_grad():
        k2.encoder.slots.add_(torch.randn_like(k2.encoder.slots))
    k2.save(str(tmp_path / "k2"))
    k4 = KTMModel.from_base(tiny_model_dir, k=4, inner_k=2, slot_weights=True)
    load_adapter_into(k4, tmp_path / "k2")
    torch.testing.assert_close(k4.encoder.inner.slots, k2.encoder.slots)
    k4.save(str(tmp_path / "k4"))
    again = KTMModel.load(str(tmp_path / "k4"))
    torch.testing.assert_close(again.encoder.inner.slots, k2.encoder.slots)
    assert again.encoder.config.inner_k == 2


@pytest.mark.parametrize("layout", [dict(k=4, slot_weights=True), dict(k=4, inner_k=2),
                                    dict(k=2, mlp_gate=True)])
def test_grown_encoder_computes_the_same_function_then_trains_its_new_units(layout):
    from ktm.core.encoder import EncoderConfig, grow_encoder

    torch.manual_seed(0)
    narrow = KTokenEncoder.from_config(EncoderConfig(16, mlp_ratio=0.5, **layout)).double()
    for p in narrow.parameters():  # a trained encoder: every weight, the last layer too, nonzero
        p.data.normal_(0, 0.3)
    wide = KTokenEncoder.from_config(EncoderConfig(16, mlp_ratio=1.5, **layout)).double()
    for p in wide.parameters():  # so that a unit grown without its zeros changes the output
        p.data.normal_(0, 0.3)
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    mask = torch.arange(11) < torch.tensor([[11], [6]])
    want = narrow(x, mask)[0]
    assert (wide(x, mask)[0] - want).abs().max() > 1e-2  # so the check below can fail
    wide.load_state_dict(grow_encoder(narrow.state_dict(), wide.state_dict()))
    torch.testing.assert_close(wide(x, mask)[0], want, atol=1e-9, rtol=1e-9)
    wide(x, mask)[0].pow(2).sum().backward()
    h = [p for n, p in narrow.named_parameters() if n.endswith("mlp.4.weight")][-1].shape[1]
    last = [p for n, p in wide.named_parameters() if n.endswith("mlp.4.weight")][-1]
    assert last.grad[:, h:].abs().sum() > 0  # the new units are trainable from the first step


def test_grow_encoder_refuses_another_layout():
    from ktm.core.encoder import EncoderConfig, grow_encoder

    narrow = KTokenEncoder.from_config(EncoderConfig(16, k=4, mlp_ratio=0.5))
    sloted = KTokenEncoder.from_config(EncoderConfig(16, k=4, mlp_ratio=1.0, slot_weights=True))
    with pytest.raises(KTMError, match="'slots' is missing from the saved encoder"):
        grow_encoder(narrow.state_dict(), sloted.state_dict())
    other_k = KTokenEncoder.from_config(EncoderConfig(16, k=2, mlp_ratio=2.0))
    with pytest.raises(KTMError, match="expected a wider MLP only"):
        grow_encoder(narrow.state_dict(), other_k.state_dict())
    two = KTokenEncoder.from_config(EncoderConfig(16, k=2, mlp_ratio=0.5))
    with pytest.raises(KTMError, match="'mlp.0.weight' has shape \\(16, 32\\)"):  # K=2 -> K=4
        grow_encoder(two.state_dict(), KTokenEncoder(16, k=4, mlp_ratio=1.0).state_dict())


@pytest.mark.parametrize("layout,deep", [(dict(k=4, inner_k=2, slot_weights=True), 8),
                                         (dict(k=2, slot_weights=True), 4)])
def test_a_segment_read_a_level_past_the_largest_merges_the_merges_again(tiny_model_dir, layout,
                                                                         deep):
    # ratio = deeper_level: the whole segment read at K*outer (a recursive encoder's outer level
    # once more) or K*K (the encoder over its own merges), its positions counted as read
    from helpers import TEXT, close, fresh_model, perturb

    from ktm.core.encoder import deeper_level
    from ktm.core.prompt import Segment

    model = fresh_model(tiny_model_dir, **layout)
    perturb(model)
    level, again = deeper_level(model.encoder)
    assert level == deep
    ids = tuple(model.tokenize(TEXT, first=True))
    prompt = [Segment("", ids=ids, ratio=deep), Segment(" Answer:", compress=False)]
    with torch.no_grad():
        cp = model.compress(prompt)
        merged, mask = model.encoder(model.input_embedding(torch.tensor([ids])))
        want, _ = again(merged, mask)
    n = -(-len(ids) // deep)
    assert cp.tokens_out == n + len(model.tokenize(" Answer:"))
    assert model.encode_prompts([tuple(prompt)], embed=False)[0].tokens_out == cp.tokens_out
    close(cp.embeds[:n], want[0])
    assert deeper_level(fresh_model(tiny_model_dir, k=1, use_mlp=False).encoder) is None


@pytest.mark.parametrize("layout,levels", [(dict(k=4, inner_k=2, slot_weights=True), (2, 4, 8)),
                                           (dict(k=2, context_blocks=2), (2,))])
def test_pieces_merged_together_are_each_merged_alone(tiny_model_dir, layout, levels):
    # a long document's runs between its plain lines, of uneven lengths, merged at once (one
    # row, each piece on whole blocks; the padded batch for an encoder reading earlier blocks)
    # give each piece's merges alone
    from helpers import close, fresh_model, perturb

    from ktm.core.encoder import reads_blocks_alone

    model = fresh_model(tiny_model_dir, **layout)
    perturb(model)
    assert reads_blocks_alone(model.encoder) == ("context_blocks" not in layout)
    enc = model._prompt_encoder()
    ids = model.tokenize("The quick brown fox jumps over the lazy dog near the bank. " * 9)
    pieces = [tuple(ids[a:b]) for a, b in ((0, 5), (5, 70), (70, 71), (71, 100))]
    for level in levels:
        with torch.no_grad():
            together = enc.merge_segments([(p, level) for p in pieces])
            for piece, got in zip(pieces, together):
                (alone,) = enc.merge_segments([(piece, level)])
                assert got.shape == alone.shape == (-(-len(piece) // level), alone.shape[-1])
                close(got, alone)
