"""Contextual merging (``context_blocks``): the MLP also reads the W blocks before each block.

What the block encoder guarantees holds: with its context weights at zero it *is* the block
encoder; a merged vector depends only on its block and the W blocks before it (appending tokens
never changes an earlier complete block's vector, so merged prefixes stay cacheable by their
ids); a batch equals its rows one by one; save -> load gives the same logits; training moves it.
"""

import pytest
import torch
from helpers import PROMPTS, fresh_model, perturb

from ktm import KTMError
from ktm.core.encoder import EncoderConfig, KTokenEncoder, grow_encoder
from ktm.model import KTMModel, trainable_parameters

LAYOUTS = [dict(k=4), dict(k=2, slot_weights=True), dict(k=4, inner_k=2, slot_weights=True)]


def _pair(layout, w=2, dtype=torch.float32):
    """A trained-looking block encoder and the same encoder with W context blocks (at zero)."""
    torch.manual_seed(0)
    block = KTokenEncoder.from_config(EncoderConfig(8, mlp_ratio=0.5, **layout))
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    ctx = KTokenEncoder.from_config(EncoderConfig(8, mlp_ratio=0.5, context_blocks=w, **layout))
    ctx.load_state_dict(grow_encoder(block.state_dict(), ctx.state_dict()))
    return block.to(dtype), ctx.to(dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_with_zero_context_weights_it_is_the_block_encoder_exactly(layout):
    block, ctx = _pair(layout)
    assert ctx.context_parameters() and all(not p.any() for p in ctx.context_parameters())
    x = torch.randn(3, 19, 8)
    mask = torch.ones(3, 19, dtype=torch.bool)
    mask[1, 11:] = False
    got, got_mask = ctx(x, mask)
    want, want_mask = block(x, mask)
    assert torch.equal(got, want) and torch.equal(got_mask, want_mask)


def _trained(layout, w=2):
    _, ctx = _pair(layout, w, torch.float64)
    with torch.no_grad():
        for p in ctx.context_parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return ctx


def assert_causal(ctx, k: int) -> None:
    """Every prefix of whole blocks merges to the full prompt's first vectors, and the first
    token reaches later blocks (the context is really read)."""
    x = torch.randn(1, 6 * k + 3, 8, dtype=torch.float64)
    full, _ = ctx(x)
    for t in range(k, x.shape[1], k):
        torch.testing.assert_close(ctx(x[:, :t])[0], full[:, : t // k], rtol=1e-12, atol=1e-12)
    y = x.clone()
    y[:, 0] += torch.randn(x.shape[-1], dtype=x.dtype)  # not a constant, which a norm removes
    assert not torch.allclose(ctx(y)[0][:, 2:], full[:, 2:])


def assert_batch_is_rows(ctx) -> None:
    """A right-padded batch equals its rows merged one by one; blocks of padding stay zero."""
    lengths = [17, 9, 4]
    x = torch.randn(3, 17, 8, dtype=torch.float64)
    mask = torch.tensor([[i < n for i in range(17)] for n in lengths])
    batch, _ = ctx(x, mask)
    for row, n in enumerate(lengths):
        alone, _ = ctx(x[row:row + 1, :n])
        blocks = alone.shape[1]
        torch.testing.assert_close(batch[row:row + 1, :blocks], alone, rtol=1e-12, atol=1e-12)
        assert not batch[row, blocks:].any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_appending_tokens_never_changes_an_earlier_complete_blocks_vector(layout):
    assert_causal(_trained(layout), layout["k"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_batch_equals_its_rows_one_by_one(layout):
    assert_batch_is_rows(_trained(layout))


def test_save_then_load_gives_identical_logits(tiny_model_dir, tmp_path):
    model = fresh_model(tiny_model_dir, k=2, context_blocks=1)
    perturb(model)
    assert model.encoder.context.weight.any()
    model.save(tmp_path / "ckpt")
    again = KTMModel.load(tmp_path / "ckpt")
    assert again.encoder.config.context_blocks == 1
    cps = model.encode_prompts(PROMPTS)
    with torch.no_grad():
        for a, b in zip(cps, again.encode_prompts(PROMPTS)):
            assert torch.equal(a.embeds, b.embeds)


def test_one_training_step_moves_the_context_weights_and_lowers_the_loss(tiny_model_dir):
    from ktm.training.train import adamw

    model = fresh_model(tiny_model_dir, k=2, context_blocks=1)
    perturb(model)  # the block MLP trained: its last layer no longer zero
    with torch.no_grad():
        model.encoder.context.weight.zero_()  # as a block reader continued with context
    model.train()
    prompts, targets = PROMPTS, ["true", "false", "positive review"]
    loss = model(prompts, targets).loss
    loss.backward()
    assert model.encoder.context.weight.grad.abs().sum() > 0
    opt = adamw([p for _, p in trainable_parameters(model)], lr=2e-3)
    opt.step()
    with torch.no_grad():
        after = model(prompts, targets).loss
    assert after.item() < loss.item() - 1e-3, (loss.item(), after.item())


def test_context_lr_sets_the_context_weights_own_group(tiny_model_dir, tmp_path):
    from ktm.training.config import TrainConfig
    from ktm.training.train import param_groups

    model = fresh_model(tiny_model_dir, k=4, inner_k=2, context_blocks=1)
    cfg = TrainConfig(out_dir=str(tmp_path), encoder_lr=1e-5, context_lr=3e-4)
    groups = {g["name"]: g for g in param_groups(model, cfg)}
    ids = {id(p) for p in groups["encoder_context"]["params"]}
    assert ids == {id(p) for p in model.encoder.context_parameters()} and len(ids) == 2
    assert groups["encoder_context"]["base_lr"] == 3e-4
    assert not ids & {id(p) for p in groups["encoder_mlp"]["params"]}
    default = {g["name"]: g for g in param_groups(model, TrainConfig(out_dir=str(tmp_path),
                                                                       encoder_lr=1e-5))}
    assert default["encoder_context"]["base_lr"] == 1e-5


def test_clip_context_apart_leaves_the_other_weights_clipped_as_without_them(tiny_model_dir,
                                                                            tmp_path):
    """Apart, the context weights' gradient no longer shrinks the LoRA's and the MLP's step:
    those are clipped exactly as they are alone, and the context weights on their own."""
    from ktm.tasks.base import Example
    from ktm.training.config import TrainConfig
    from ktm.training.train import adamw, param_groups, train_step

    model = fresh_model(tiny_model_dir, k=2, context_blocks=1)
    perturb(model)
    with torch.no_grad():
        model.encoder.context.weight.normal_(0, 0.3)  # trained: the gradient reaches it
    model.eval()  # no dropout: every step sees the same gradient
    window = [Example(p, t) for p, t in zip(PROMPTS, ["true", "false", "positive review"])]
    cfg = TrainConfig(out_dir=str(tmp_path), lr=1e-30, encoder_lr=1e-30, context_lr=1e-30)

    def clipped_grads(clip, apart=()):
        opt = adamw(param_groups(model, cfg), lr=1e-30)
        opt.zero_grad = lambda set_to_none=True: None  # keep the clipped grads to read them
        st = train_step(model, opt, window, 2, clip_norm=clip, clip_apart=apart)
        grads = {g["name"]: torch.cat([p.grad.flatten() for p in g["params"]])
                 for g in opt.param_groups}
        for p in model.parameters():
            p.grad = None
        return st, grads

    def norm(grads, names):
        return float(torch.cat([grads[n] for n in names]).norm())

    _, raw = clipped_grads(0.0)  # unclipped
    ctx, rest = ["encoder_context"], [n for n in raw if n != "encoder_context"]
    clip = min(norm(raw, ctx), norm(raw, rest)) / 10  # both parts far above it
    together, g1 = clipped_grads(clip)
    apart, g2 = clipped_grads(clip, ctx)
    assert not together.apart_norms
    torch.testing.assert_close(apart.apart_norms["encoder_context"], norm(raw, ctx), rtol=1e-4,
                               atol=0)
    torch.testing.assert_close(apart.grad_norm, together.grad_norm, rtol=1e-4, atol=0)
    torch.testing.assert_close(norm(g1, rest + ctx), clip, rtol=1e-4, atol=0)  # one clip
    torch.testing.assert_close(norm(g2, rest), clip, rtol=1e-4, atol=0)  # each part at it
    torch.testing.assert_close(norm(g2, ctx), clip, rtol=1e-4, atol=0)
    assert norm(g1, rest) < clip * 0.999  # together, the context weights took part of it
    for n in rest:  # the same direction, only a different scale
        torch.testing.assert_close(g2[n] / norm(g2, rest), raw[n] / norm(raw, rest))


def test_clip_context_apart_without_context_weights_is_refused(tiny_model_dir, tmp_path):
    from ktm.tasks.base import Example
    from ktm.training.config import TrainConfig
    from ktm.training.train import train

    model = fresh_model(tiny_model_dir, k=2)
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), max_steps=1, clip_context_apart=True,
                      progress=False)
    with pytest.raises(KTMError, match="no contextual encoder weights"):
        train(model, [Example(PROMPTS[0], "true")], cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("kw,match", [
    (dict(context_blocks=-1), "context_blocks must be an integer >= 0, got -1"),
    (dict(context_blocks=1.5), "context_blocks must be an integer >= 0, got 1.5"),
    (dict(context_blocks=1, use_mlp=False), "needs use_mlp=True"),
])
def test_bad_context_settings_are_clear_errors(kw, match):
    with pytest.raises(KTMError, match=match):
        EncoderConfig(8, **kw)


def test_a_checkpoint_read_with_other_context_blocks_is_refused(tiny_model_dir, tmp_path, capsys):
    """Outside training a checkpoint is read as it was trained (``ktm pretrain --init`` may add
    context blocks to a block reader: tests/training/test_pretrain.py)."""
    from ktm.cli.main import main

    model = fresh_model(tiny_model_dir, k=2, slot_weights=True)
    perturb(model)
    model.save(tmp_path / "ckpt")
    code = main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--context-blocks", "1",
                 "--task", "tree", "--n-eval", "2"])
    assert code != 0
    assert "--context-blocks 1 contradicts checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------- context_layers (the LM's own)

def _cumulative(embeds, mask):
    """A causal stand-in for the LM's states: the running sum (each position sees only earlier
    ones), so the encoder-level checks need no LM."""
    return torch.cumsum(embeds * mask[..., None].to(embeds.dtype), dim=1)


def _states_pair(layout, dtype=torch.float32, pool="mean", states=_cumulative):
    torch.manual_seed(0)
    block = KTokenEncoder.from_config(EncoderConfig(8, mlp_ratio=0.5, **layout))
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    ctx = KTokenEncoder.from_config(EncoderConfig(8, mlp_ratio=0.5, context_layers=1,
                                                  context_pool=pool, **layout))
    ctx.load_state_dict(grow_encoder(block.state_dict(), ctx.state_dict()))
    ctx.bind_lm(states)
    return block.to(dtype), ctx.to(dtype)


POOLS = {"mean": 4, "query": 7}  # each pool's context weights: the MLP's 2 layers (+ q, kv, o)


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_context_with_its_mlp_at_zero_is_the_block_encoder_exactly(layout, pool):
    block, ctx = _states_pair(layout, pool=pool)
    assert len(ctx.context_parameters()) == POOLS[pool]
    x = torch.randn(3, 19, 8)
    mask = torch.ones(3, 19, dtype=torch.bool)
    mask[1, 11:] = False
    assert torch.equal(ctx(x, mask)[0], block(x, mask)[0])


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_context_is_causal_and_a_batch_equals_its_rows(layout, pool):
    _, ctx = _states_pair(layout, torch.float64, pool)
    with torch.no_grad():
        for p in ctx.context_parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    assert_causal(ctx, layout["k"])
    assert_batch_is_rows(ctx)


def _own_states(embeds, mask):
    """A stand-in LM that reads no context: each state is its own token's embedding."""
    return embeds


def test_pooled_queries_read_the_blocks_before_and_start_as_the_mean():
    """With the mean pool and context-free states a block's vector reads its own tokens only;
    ARC's pooled query reads every token up to its block's end. Its output projection at zero
    gives the mean pool exactly."""
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    mask = torch.ones(2, 12, dtype=torch.bool)
    changed = x.clone()
    changed[:, 1] += 1.0  # a token of the first block (K=4)
    merged = {}
    for pool in POOLS:
        _, ctx = _states_pair(dict(k=4), torch.float64, pool, _own_states)
        with torch.no_grad():
            for p in ctx.context_parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        with torch.no_grad():
            a, b = ctx(x, mask)[0], ctx(changed, mask)[0]
        assert torch.equal(a[:, 1:], b[:, 1:]) == (pool == "mean")
        merged[pool] = (ctx, a)
    ctx, _ = merged["query"]
    with torch.no_grad():
        ctx.states.attend.o.weight.zero_()
        for name, p in ctx.states.mlp.named_parameters():
            p.copy_(dict(merged["mean"][0].states.mlp.named_parameters())[name])
        assert torch.equal(ctx(x, mask)[0], merged["mean"][1])


@pytest.mark.parametrize("kw,match", [
    (dict(context_layers=1, context_pool="max"), "context_pool must be mean or query, got 'max'"),
    (dict(context_pool="query"), "context_pool='query' pools the LM's layer states: it needs "
                                 "context_layers >= 1"),
])
def test_bad_context_pool_is_a_clear_error(kw, match):
    with pytest.raises(KTMError, match=match):
        EncoderConfig(8, **kw)


def test_an_unbound_layer_context_is_a_clear_error():
    ctx = KTokenEncoder.from_config(EncoderConfig(8, context_layers=1))
    with pytest.raises(KTMError, match="no LM is bound"):
        ctx(torch.randn(1, 8, 8))


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_the_states_read_are_the_lms_own_after_layer_l(family, tmp_path):
    """The hook stops the LM after layer L; what it returns equals the full forward's hidden
    states after that layer, with the sink row first and the adapter off."""
    from helpers import save_tiny

    from ktm.core.context_states import LayerStates

    save_tiny(family, tmp_path / family)
    model = fresh_model(str(tmp_path / family), k=2, context_layers=1)
    perturb(model)  # a non-zero LoRA, which the states must not see
    src = LayerStates(model.peft.get_base_model(), 1, 0, model.peft.disable_adapter)
    embeds = model.input_embedding(torch.tensor([[5, 9, 3, 7, 11, 2]]))
    got = src(embeds, torch.ones(1, 6, dtype=torch.bool))
    lm = model.peft.get_base_model()
    x = torch.cat([model.input_embedding(torch.tensor([[0]])), embeds], 1)
    with torch.no_grad(), model.peft.disable_adapter():
        want = lm(inputs_embeds=x, output_hidden_states=True).hidden_states[1][:, 1:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        lora_on = lm(inputs_embeds=x, output_hidden_states=True).hidden_states[1][:, 1:]
    assert not torch.allclose(got, lora_on, atol=1e-4)


def test_what_the_mean_pool_feeds_its_mlp_is_each_blocks_mean_of_layer_l_states(tiny_model_dir):
    """The issue's start test for (a), where this design adds (a) to the block encoder: with the
    mean pool, what reaches the zero-started MLP is, per block of K, the mean of the base LM's
    layer-L states (each RMS-normalised), padding left out."""
    from ktm.core.context_states import LayerStates

    model = fresh_model(tiny_model_dir, k=2, context_layers=2)
    perturb(model)
    got = []
    hook = model.encoder.states.mlp.register_forward_hook(lambda m, a, out: got.append(a[0]))
    embeds = model.input_embedding(torch.tensor([[5, 9, 3, 7, 11, 2, 8], [4, 6, 1, 0, 0, 0, 0]]))
    mask = torch.tensor([[1] * 7, [1] * 3 + [0] * 4], dtype=torch.bool)
    with torch.no_grad():
        model.encoder(embeds, mask)
    hook.remove()
    src = LayerStates(model.peft.get_base_model(), 2, model.encoder.states.source.sink_id,
                      model.peft.disable_adapter)
    for row, n in enumerate((7, 3)):
        h = src(embeds[row:row + 1, :n], mask[row:row + 1, :n])[0]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        want = torch.stack([h[i:i + 2].mean(0) for i in range(0, n, 2)])
        torch.testing.assert_close(got[0][row, :len(want)], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool", POOLS)
def test_a_layer_context_model_trains_saves_and_loads(tiny_model_dir, tmp_path, pool):
    from ktm.training.train import adamw

    model = fresh_model(tiny_model_dir, k=4, inner_k=2, context_layers=2, context_pool=pool)
    perturb(model)
    model.train()
    loss = model(PROMPTS, ["true", "false", "positive review"]).loss
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for p in model.encoder.context_parameters())
    adamw([p for _, p in trainable_parameters(model)], lr=2e-3).step()
    with torch.no_grad():
        after = model(PROMPTS, ["true", "false", "positive review"]).loss
    assert after.item() < loss.item() - 1e-3
    model.eval()
    model.save(tmp_path / "ckpt")
    again = KTMModel.load(tmp_path / "ckpt")
    with torch.no_grad():
        for a, b in zip(model.encode_prompts(PROMPTS), again.encode_prompts(PROMPTS)):
            assert torch.equal(a.embeds, b.embeds)
    assert again.generate(PROMPTS[1], max_new_tokens=6) == model.generate(PROMPTS[1],
                                                                           max_new_tokens=6)


def test_more_context_layers_than_the_model_has_is_a_clear_error(tiny_model_dir):
    with pytest.raises(KTMError, match="context_layers=3 is more than the base model's 2 "
                                       "layers: expected 1 to 2"):
        fresh_model(tiny_model_dir, k=2, context_layers=3)
    with pytest.raises(KTMError, match="context_layers must be an integer >= 0, got -1"):
        EncoderConfig(8, context_layers=-1)


def test_a_layer_context_reader_on_another_base_model_is_refused(tiny_model_dir, tmp_path):
    from helpers import save_tiny

    model = fresh_model(tiny_model_dir, k=2, context_layers=1)
    model.save(tmp_path / "ckpt")
    save_tiny("qwen2", tmp_path / "other")
    with pytest.raises(KTMError, match="base"):
        KTMModel.load(tmp_path / "ckpt", base=str(tmp_path / "other"))


# ------------------------------------------------- context_transformer (a small one of its own)

def _mixer_pair(layout, layers=2, dtype=torch.float32):
    torch.manual_seed(0)
    block = KTokenEncoder.from_config(EncoderConfig(8, mlp_ratio=0.5, **layout))
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    ctx = KTokenEncoder.from_config(EncoderConfig(8, mlp_ratio=0.5, context_transformer=layers,
                                                  **layout))
    ctx.load_state_dict(grow_encoder(block.state_dict(), ctx.state_dict()))
    return block.to(dtype), ctx.to(dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_mixer_at_its_start_is_the_block_encoder_exactly(layout):
    block, ctx = _mixer_pair(layout)
    assert ctx.context_parameters()
    assert any(p.any() for p in ctx.context_parameters())  # only the output projections are 0
    x = torch.randn(3, 19, 8)
    mask = torch.ones(3, 19, dtype=torch.bool)
    mask[1, 11:] = False
    got, got_mask = ctx(x, mask)
    want, want_mask = block(x, mask)
    assert torch.equal(got, want) and torch.equal(got_mask, want_mask)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_mixer_is_causal_and_a_batch_equals_its_rows(layout):
    _, ctx = _mixer_pair(layout, dtype=torch.float64)
    with torch.no_grad():
        for p in ctx.context_parameters():
            p.add_(torch.randn_like(p) * 0.3)
    assert_causal(ctx, layout["k"])
    assert_batch_is_rows(ctx)


def test_token_mixer_changes_each_token_at_its_own_scale():
    """The layers read each token at unit RMS and return their change at the token's scale:
    scaling the embeddings scales what the mixer returns by the same factor, so a trained mixer's
    change to small input embeddings stays as small as they are."""
    from ktm.core.context_mixer import TokenMixer

    torch.manual_seed(0)
    mixer = TokenMixer(16, 2).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    out = mixer(x)
    assert not torch.allclose(out, x)
    for c in (0.01, 7.0):
        # to the eps under the RMS's square root, 1e-12 against a mean square of c**2
        torch.testing.assert_close(mixer(c * x) / c, out, rtol=1e-6, atol=1e-7)


def test_token_mixer_heads_are_about_64_wide():
    from ktm.core.context_mixer import heads_for

    assert [heads_for(d) for d in (576, 960, 2048, 8, 100)] == [9, 15, 32, 1, 2]


def test_a_token_mixer_model_trains_saves_and_loads(tiny_model_dir, tmp_path):
    from ktm.training.train import adamw

    model = fresh_model(tiny_model_dir, k=4, inner_k=2, context_transformer=1)
    perturb(model)
    model.train()
    loss = model(PROMPTS, ["true", "false", "positive review"]).loss
    loss.backward()
    mixer = model.encoder.mixer.layers[0]
    assert mixer.down.weight.grad.abs().sum() > 0  # the zero output projections move first
    assert mixer.out.weight.grad.abs().sum() > 0
    adamw([p for _, p in trainable_parameters(model)], lr=2e-3).step()
    with torch.no_grad():
        after = model(PROMPTS, ["true", "false", "positive review"]).loss
    assert after.item() < loss.item() - 1e-3
    model.eval()
    model.save(tmp_path / "ckpt")
    again = KTMModel.load(tmp_path / "ckpt")
    assert again.encoder.config.context_transformer == 1
    with torch.no_grad():
        for a, b in zip(model.encode_prompts(PROMPTS), again.encode_prompts(PROMPTS)):
            assert torch.equal(a.embeds, b.embeds)
    assert again.generate(PROMPTS[1], max_new_tokens=6) == model.generate(PROMPTS[1],
                                                                           max_new_tokens=6)


def test_bad_context_transformer_is_a_clear_error():
    with pytest.raises(KTMError, match="context_transformer must be an integer >= 0, got -2"):
        EncoderConfig(8, context_transformer=-2)


# ------------------------------------------------------ every option: what a merged vector keys on

CONTEXTS = [dict(context_blocks=1), dict(context_layers=1),
            dict(context_layers=1, context_pool="query"), dict(context_transformer=1)]


@pytest.mark.parametrize("context", CONTEXTS)
def test_a_segments_vectors_depend_on_its_own_tokens_only_so_the_merge_cache_may_key_on_them(
        tiny_model_dir, context):
    """Every contextual option reads context within its segment only: a segment merges to the
    same vectors whatever segments come before it, so ``ktm serve``'s merge cache, keyed by a
    segment's ids, hands back exactly what merging it afresh in another prompt gives."""
    from ktm import Segment

    model = fresh_model(tiny_model_dir, k=2, **context)
    perturb(model)
    model.eval()
    shared = "the shared document, merged in both prompts and cached after the first"

    def prompt(first):
        return [Segment(first), Segment(" then:", compress=False), Segment(shared),
                Segment(" Answer:", compress=False)]

    cache: dict = {}
    with torch.no_grad():
        first = model.encode_prompts([prompt("one text before it")], cache=cache)[0]
        cached = model.encode_prompts([prompt("another, longer text before the shared one")],
                                      cache=cache)[0]
        fresh = model.encode_prompts([prompt("another, longer text before the shared one")])[0]
    assert len(cache) == 3  # the two first segments and the shared one, merged once
    torch.testing.assert_close(cached.embeds, fresh.embeds)
    # the shared segment's vectors and the plain answer after it: the same in both prompts
    tail = -(-len(model.tokenize(shared, False)) // 2) + len(model.tokenize(" Answer:", False))
    torch.testing.assert_close(fresh.embeds[-tail:], first.embeds[-tail:])
    assert not torch.allclose(fresh.embeds[:3], first.embeds[:3])  # what differs before it
