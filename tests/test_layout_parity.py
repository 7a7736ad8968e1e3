"""The parity properties under every prompt layout and across families: K=1 merging is the base
model, a padded batch is its rows one by one, cached decoding is a full re-run, the loss path's
logits are the decoder's, and a saved model reloads exactly.

Families: llama and gemma (tied embeddings; gemma scales its embeddings) under every layout;
gpt2 (learned absolute positions), granite (an embedding multiplier), qwen2, phi and a tied llama
whose tokenizer opens every text with a BOS under the combined layout. Prompts: much longer than
a block, shorter than one, lengths that are not a multiple of K, several merged segments between
plain ones, empty lines.

Device-aware: ``KTM_TEST_DEVICE`` and ``KTM_TEST_DTYPE`` (tests/helpers.py) run the suite on
another device or dtype. In fp32 logits agree to 1e-4 and greedy tokens exactly, as on the CPU;
in 16-bit, logits agree norm-wise within the dtype's tolerance (``helpers.NORM_TOL``), and
greedy tokens, which a rounding can tip at a near-tie, are not compared.
"""

import pytest
import torch
from helpers import (
    DEVICE,
    DTYPE,
    close,
    decode_rejoining,
    perturb,
    require_device,
    save_tiny,
    save_tiny_llama,
)
from transformers import AutoModelForCausalLM

from ktm import Segment
from ktm.core.loss import target_ids, target_logits
from ktm.decode.batched import prefill_from_kv, row_kv
from ktm.decode.generate import advance, generate_ids, prefill
from ktm.model import KTMModel, prompt_logits, trainable_parameters

LONG = ("The quick brown fox jumps over the lazy dog.\nHello world, my name is ktm.\n"
        "def add(a, b):\n    return a + b\n")
PROMPTS = [
    LONG,
    "Hi",  # shorter than one block
    "Hello world, my",  # not a multiple of K
    [Segment("Hello world\nfox"), Segment(" then ", compress=False),
     Segment("The lazy dog.\nquick brown"), Segment(" Answer:", compress=False)],
    [Segment("a\n\n\nb\n"), Segment(" Q", compress=False), Segment("\n")],
]
TARGETS = ["fox jumps", "world", "the lazy", "dog", "b"]

ALL = dict(plain_prefix=2, plain_suffix=3, align_lines=True, spread_positions=True, inner_k=2,
           slot_weights=True, mlp_gate=True)
LAYOUTS = {
    "default": {}, "plain_prefix": dict(plain_prefix=2), "plain_suffix": dict(plain_suffix=3),
    "align_lines": dict(align_lines=True), "spread_positions": dict(spread_positions=True),
    "inner_k": dict(inner_k=2), "slot_weights": dict(slot_weights=True),
    "mlp_gate": dict(mlp_gate=True), "all": ALL,
}
CASES = ([(f, lay) for f in ("llama", "gemma") for lay in LAYOUTS]
         + [(f, "all") for f in ("gpt2", "granite", "qwen2", "phi")]
         + [("gpt2", "spread_positions"), ("llama-bos", "all")])


EXACT = DTYPE == "float32"  # greedy tokens compared exactly (module docstring)


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Logits of two paths that compute the same thing, as closely as the test dtype allows."""
    if EXACT:
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    else:
        close(a, b)


@pytest.fixture(scope="module", autouse=True)
def device_is_there():
    require_device()


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> saved tiny model folder, each built once."""
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            if name == "llama-bos":  # conftest's tied llama whose tokenizer opens with a BOS
                save_tiny_llama(path, bos=True)
            else:
                save_tiny(name, path)
            built[name] = str(path)
        return built[name]

    return get


def build(families, family: str, layout: str, k: int = 4) -> KTMModel:
    torch.manual_seed(0)
    model = KTMModel.from_base(families(family), k=k, device=DEVICE, dtype=DTYPE,
                               **LAYOUTS[layout])
    perturb(model)  # LoRA, the encoder MLP, slot weights and gate all away from their no-op init
    return model


@torch.no_grad()
@pytest.mark.parametrize("family, layout", CASES)
def test_a_padded_batch_equals_its_rows_one_by_one(families, family, layout):
    model = build(families, family, layout)
    table = model.input_embedding.weight  # a trained model's pad row is not a fresh padding_idx's
    table[model.pad_id] = torch.randn(table.shape[1], device=table.device,
                                      dtype=table.dtype)  # zeros: pads must be masked, not zero
    batch = model.encode_prompts(PROMPTS)  # the encoder's segments right-padded together
    for cp, p in zip(batch, PROMPTS):
        alone = model.encode_prompts([p])[0]
        if EXACT:
            torch.testing.assert_close(cp.embeds, alone.embeds, atol=1e-6, rtol=1e-5)
        else:
            close(cp.embeds, alone.embeds)
        assert (cp.tokens_in, cp.tokens_out) == (alone.tokens_in, alone.tokens_out)
    # the LM's rows left-padded together
    logits = target_logits(model, PROMPTS, TARGETS).logits
    rows = [target_logits(model, [p], [t]).logits for p, t in zip(PROMPTS, TARGETS)]
    same(logits, torch.cat(rows))
    together = generate_ids(model, PROMPTS, max_new_tokens=6, stop_at_eos=False)
    assert not EXACT or together == [generate_ids(model, p, max_new_tokens=6, stop_at_eos=False)[0]
                        for p in PROMPTS]


@torch.no_grad()
@pytest.mark.parametrize("family, layout", CASES)
def test_cached_decode_equals_a_full_rerun_and_the_loss_paths_logits(families, family, layout):
    """Step by step the cached and the uncached decoders give the same logits, and feeding a
    target's tokens gives the logits the training forward computes for them."""
    model = build(families, family, layout)
    cps = model.encode_prompts(PROMPTS)
    targets = [target_ids(model, t) for t in TARGETS]
    want = target_logits(model, PROMPTS, TARGETS)
    cached, full = prefill(model, cps), prefill(model, cps, use_cache=False)
    for step in range(max(len(t) for t in targets)):
        same(cached.logits, full.logits)
        for i, t in enumerate(targets):
            if step < len(t):
                same(cached.logits[i], want.logits[want.rows == i][step])
        nxt = torch.tensor([t[step] if step < len(t) else 0 for t in targets],
                           device=model.device)
        advance(model, cached, nxt)
        advance(model, full, nxt)
    assert not EXACT or generate_ids(model, PROMPTS, max_new_tokens=6) == generate_ids(
        model, PROMPTS, max_new_tokens=6, use_cache=False)


def _settings(model: KTMModel) -> dict:
    d = model.config.to_dict()
    d["lora"]["target_modules"] = sorted(d["lora"]["target_modules"])  # load reads them sorted
    return d


@torch.no_grad()
@pytest.mark.parametrize("family, layout", CASES)
def test_a_saved_model_reloads_with_identical_logits(families, family, layout, tmp_path):
    model = build(families, family, layout)
    model.save(tmp_path / "ck")
    loaded = KTMModel.load(tmp_path / "ck", device=DEVICE, dtype=DTYPE)
    assert _settings(loaded) == _settings(model)
    assert not any(p.requires_grad for p in loaded.parameters())
    training = [prompt_logits(model, p) for p in PROMPTS]  # fp32 encoder masters, autocast
    model.requires_grad_(False)  # frozen, as loaded: the encoder read in the LM's dtype
    for p, t in zip(PROMPTS, training):
        got = prompt_logits(loaded, p)
        assert torch.equal(got, prompt_logits(model, p))
        close(got, t)  # which rounds differently from autocast in bf16, and nothing more


K1_CASES = [(f, lay) for f, lay in CASES if lay != "inner_k"]  # no inner level below K=1


def _k1(layout: str) -> dict:
    return {k: v for k, v in LAYOUTS[layout].items() if k != "inner_k"}


@torch.no_grad()
@pytest.mark.parametrize("family, layout", K1_CASES)
def test_k1_merging_is_the_base_model(families, family, layout):
    """Untrained, K=1 merging is the base model reading the prompt's tokens; with a trained
    LoRA, it is the same model reading the prompt unmerged."""
    path = families(family)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE).to(DEVICE).eval()
    model = KTMModel.from_base(path, k=1, device=DEVICE, dtype=DTYPE, **_k1(layout))
    for p in PROMPTS:
        segs = [Segment(p)] if isinstance(p, str) else p
        ids = [i for n, s in enumerate(segs) for i in model.tokenize(s.text, n == 0)]
        same(prompt_logits(model, p), base(torch.tensor([ids], device=DEVICE)).logits[0])
    g = torch.Generator().manual_seed(0)
    for n, w in trainable_parameters(model):
        if "lora_B" in n:
            w.add_((torch.randn(w.shape, generator=g) * 0.1).to(w.device))
    for p in PROMPTS:
        same(prompt_logits(model, p), prompt_logits(model, p, merge=False))


@torch.no_grad()
@pytest.mark.parametrize("family, layout", [("llama", "all"), ("gpt2", "spread_positions")])
def test_continuous_batching_and_a_stored_kv_prefix_keep_the_layouts_positions(
        families, family, layout):
    """Rows joined and dropped mid-decode, and a row prefilled from a stored KV prefix (the
    server's paths), decode as each prompt alone, spread position ids included."""
    model = build(families, family, layout)
    alone = generate_ids(model, PROMPTS, max_new_tokens=8, stop_at_eos=False)
    cps = model.encode_prompts(PROMPTS)
    assert not EXACT or decode_rejoining(model, cps, [1, 2], 8) == alone
    full = cps[3]
    donor = prefill(model, [cps[1], full])
    for n in (1, full.tokens_out - 1):
        rest = None if full.positions is None else full.positions[n:]
        part = prefill_from_kv(model, row_kv(donor, 1, n), full.embeds[n:], rest)
        same(part.logits, prefill(model, [full]).logits)
