"""The llama.cpp backend against the torch path on the tiny Llama: logits, greedy generations, a
batch against its prompts one by one, the KV cache kept across requests, and the export's errors.

The base is written as an F32 GGUF and the runtime keeps an F32 KV cache without flash attention
(``kv_type="f32"``), so both paths compute the same function in the same precision. Each check
runs on both forms of an export: the LoRA folded into the weights (``model.gguf``, the default)
and base + adapter (``fold_lora=False``)."""

import json
import shutil

import pytest
import torch
from helpers import PROMPTS, fresh_model, perturb

from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.llamacpp.export import MANIFEST, GGUFOptions, export_gguf, read_manifest
from ktm.llamacpp.runtime import RuntimeConfig
from ktm.model import KTMModel

pytestmark = pytest.mark.llamacpp
EXACT = RuntimeConfig(kv_type="f32", threads=1, sequences=4)
DOC = ("def add(a, b):\n    return a + b\n# Update the old python code content. The quick brown "
       "fox jumps over the lazy dog. Hello world, my name is ktm.")


@pytest.fixture
def checkpoint(tiny_model_dir, tmp_path):
    model = fresh_model(tiny_model_dir, k=2)
    perturb(model)
    model.save(tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.fixture(params=[True, False], ids=["folded", "adapter"])
def pair(checkpoint, tmp_path, request):
    """The same checkpoint on torch and on llama.cpp (exported into ``tmp/export``)."""
    torch_model = KTMModel.load(checkpoint)
    export_gguf(torch_model, tmp_path / "export", source=checkpoint,
                opts=GGUFOptions(fold_lora=request.param))
    llama = KTMModel.load(checkpoint, backend="llamacpp", gguf=tmp_path / "export",
                          llamacpp=EXACT)
    return torch_model, llama


def test_logits_of_a_merged_prompt_equal_the_torch_paths(pair):
    torch_model, llama = pair
    cp = torch_model.encode_prompts([(Segment(DOC), Segment(" Answer:", compress=False))])[0]
    assert cp.tokens_out < cp.tokens_in  # merged
    with torch.no_grad():
        mask = torch.ones(1, cp.tokens_out, dtype=torch.long)
        pos = torch.arange(cp.tokens_out)[None]
        want = torch_model.lm(cp.embeds[None], mask, pos)[0]
    got = llama.runtime.row_logits(cp.embeds)
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-3, rel


def test_greedy_generations_are_identical_and_a_batch_equals_its_prompts_one_by_one(pair):
    torch_model, llama = pair
    prompts = PROMPTS + [[Segment(DOC), Segment(" Answer:", compress=False)]]
    want = torch_model.generate(prompts, max_new_tokens=32, stop_at_eos=False)
    assert llama.generate(prompts, max_new_tokens=32, stop_at_eos=False) == want
    assert [llama.generate(p, max_new_tokens=32, stop_at_eos=False) for p in prompts] == want
    assert "".join(llama.stream(prompts[0], max_new_tokens=32, stop_at_eos=False)) == want[0]


def test_a_request_sharing_a_merged_prefix_reuses_its_cache_and_gets_the_same_tokens(pair):
    torch_model, llama = pair
    first = [Segment(DOC), Segment(" Question one:", compress=False)]
    second = [Segment(DOC), Segment(" Another question:", compress=False)]
    llama.generate(first, max_new_tokens=8, stop_at_eos=False)
    got = llama.generate(second, max_new_tokens=16, stop_at_eos=False)
    cp = llama.encode_prompts([tuple(second)])[0]
    state = llama.runtime.prefill([cp])  # what the cache held when the second request came
    llama.runtime.release(state)
    assert got == torch_model.generate(second, max_new_tokens=16, stop_at_eos=False)
    llama.runtime.clear()
    assert llama.generate(second, max_new_tokens=16, stop_at_eos=False) == got
    assert state.reused[0] > 0


def test_an_export_holds_a_checkpoint_and_loads_by_itself(pair, tmp_path):
    torch_model, _ = pair
    m = read_manifest(tmp_path / "export")
    assert m["k"] == 2 and m["spread_positions"] is False
    assert m["embedding_check"]["relative_difference"] <= m["embedding_check"]["tolerance"]
    again = KTMModel.load(tmp_path / "export", backend="llamacpp", llamacpp=EXACT)
    assert again.runtime.name == "llamacpp"
    assert again.generate(PROMPTS[0], max_new_tokens=8) == torch_model.generate(
        PROMPTS[0], max_new_tokens=8)


def test_a_missing_or_changed_base_gguf_and_a_mismatched_manifest_are_errors(pair, tmp_path,
                                                                         checkpoint):
    """The GGUF llama.cpp runs: the folded model where the export has one, else the base."""
    export = tmp_path / "export"
    m = read_manifest(export)
    name, what = ("model.gguf", "model gguf") if m["model_gguf"] else ("base.gguf", "base gguf")
    moved = tmp_path / "moved.gguf"
    shutil.move(export / name, moved)
    with pytest.raises(KTMError, match=f"{what} .* is missing"):
        KTMModel.load(checkpoint, backend="llamacpp", gguf=export, llamacpp=EXACT)
    (export / name).write_bytes(moved.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(KTMError, match="sha256"):
        KTMModel.load(checkpoint, backend="llamacpp", gguf=export, llamacpp=EXACT)
    shutil.move(moved, export / name)
    manifest = json.loads((export / MANIFEST).read_text())
    manifest["k"] = 4
    (export / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(KTMError, match="another prompt layout.*k: export 4, model 2"):
        KTMModel.load(checkpoint, backend="llamacpp", gguf=export, llamacpp=EXACT)


def test_an_export_inside_the_model_folder_is_refused_and_writes_nothing(checkpoint):
    model = KTMModel.load(checkpoint)
    before = sorted(p.name for p in checkpoint.iterdir())
    with pytest.raises(KTMError, match="is inside the model folder"):
        export_gguf(model, checkpoint / "gguf", source=checkpoint)
    assert sorted(p.name for p in checkpoint.iterdir()) == before


def test_a_missing_base_gguf_given_by_path_is_an_error(checkpoint, tmp_path):
    model = KTMModel.load(checkpoint)
    with pytest.raises(KTMError, match="base GGUF .*nowhere.gguf.* is missing"):
        export_gguf(model, tmp_path / "out",
                    opts=GGUFOptions(base_gguf=str(tmp_path / "nowhere.gguf")))
    assert not (tmp_path / "out").exists()


def test_a_model_whose_input_embeddings_llama_cpp_reads_otherwise_is_refused(checkpoint, tmp_path,
                                                                           monkeypatch):
    """The check compares logits: ktm's rows scaled (as an embedding multiplier or Gemma's
    sqrt(D) scale would) read differently from llama.cpp's own lookup of the same ids."""
    model = KTMModel.load(checkpoint)
    plain = model.input_embedding

    class Scaled(torch.nn.Module):
        weight = property(lambda self: plain.weight)

        def forward(self, ids):
            return plain(ids) * 8.0

    monkeypatch.setattr(KTMModel, "input_embedding", property(lambda self: Scaled()))
    with pytest.raises(KTMError, match="reads the 'llama' model's input embeddings differently"):
        export_gguf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_spread_position_model_is_refused_naming_the_reader_to_use(tiny_model_dir, tmp_path):
    model = fresh_model(tiny_model_dir, k=2, spread_positions=True)
    with pytest.raises(KTMError, match="smollm2-135m-k4-seq"):
        export_gguf(model, tmp_path / "out")
    with pytest.raises(KTMError, match="consecutive positions"):
        model.use_backend("llamacpp")
    assert not (tmp_path / "out").exists()


def test_without_the_extra_the_error_says_how_to_install_it(tiny_model_dir, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_llama(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ImportError("No module named 'llama_cpp'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    model = fresh_model(tiny_model_dir, k=2)
    with pytest.raises(KTMError, match=r"pip install 'ktm\[llamacpp\]'") as e:
        model.use_backend("llamacpp")
    assert "\n" not in str(e.value)


def test_scoring_reads_target_log_probs_through_llama_cpp_as_torch_does(pair):
    """``forward`` (R, likelihood scoring, perplexity) in eval mode runs on llama.cpp."""
    torch_model, llama = pair
    prompts = [[Segment(DOC), Segment(" Answer:", compress=False)], PROMPTS[0]]
    targets = ["true", [5, 9, 17, 3]]
    want = torch_model(prompts, targets)
    got = llama(prompts, targets)
    assert torch.equal(got.n_tokens, want.n_tokens) and got.tokens_out == want.tokens_out
    assert torch.allclose(got.nll, want.nll, rtol=1e-4, atol=1e-4)
    calls = []
    real = llama.runtime.score
    llama.runtime.score = lambda *a: calls.append(1) or real(*a)
    llama(prompts, targets)
    llama.train()
    llama(prompts, targets)  # training: torch
    assert calls == [1]


@pytest.mark.parametrize("context", [dict(context_layers=1), dict(context_transformer=1),
                                     dict(context_layers=1, context_pool="query")])
def test_a_contextual_encoder_runs_on_llama_cpp(tiny_model_dir, tmp_path, context):
    """The encoder (with the LM's first layers it may read) stays in torch; only the merged
    prefix goes to llama.cpp, so a contextual model generates there as on torch."""
    model = fresh_model(tiny_model_dir, k=2, **context)
    perturb(model)
    model.save(tmp_path / "ctx")
    torch_model = KTMModel.load(tmp_path / "ctx")
    export_gguf(torch_model, tmp_path / "ctx-gguf", source=tmp_path / "ctx")
    llama = KTMModel.load(tmp_path / "ctx-gguf", backend="llamacpp", llamacpp=EXACT)
    prompt = [Segment(DOC), Segment(" Answer:", compress=False)]
    assert llama.generate(prompt, max_new_tokens=16, stop_at_eos=False) == torch_model.generate(
        prompt, max_new_tokens=16, stop_at_eos=False)


def test_a_prompt_read_at_a_ratio_runs_on_llama_cpp(tiny_model_dir, tmp_path):
    """Adaptive merging keeps positions consecutive: a reader of levels 8, 4 and 2 read at a
    ratio (each unit at its own level, plain ones too) generates on llama.cpp as on torch."""
    model = fresh_model(tiny_model_dir, k=8, inner_k=(4, 2), slot_weights=True, ratio=2.5,
                        allocator="rules")
    perturb(model)
    model.save(tmp_path / "mixed")
    torch_model = KTMModel.load(tmp_path / "mixed")
    export_gguf(torch_model, tmp_path / "mixed-gguf", source=tmp_path / "mixed")
    llama = KTMModel.load(tmp_path / "mixed-gguf", backend="llamacpp", llamacpp=EXACT)
    prompts = [[Segment(DOC), Segment(" Answer:", compress=False)], [Segment(DOC, ratio=6)]]
    levels = {lv for ids, lv, _ in torch_model._prompt_encoder().layout(
        [tuple(p) for p in prompts])[0]}
    assert {0, 2} <= levels  # a real mix: plain tokens and merges in one segment
    want = torch_model.generate(prompts, max_new_tokens=16, stop_at_eos=False)
    assert llama.generate(prompts, max_new_tokens=16, stop_at_eos=False) == want


def test_a_lora_of_merged_rows_reads_on_llama_cpp_as_on_torch(tiny_model_dir, tmp_path):
    """Scope "merged": llama.cpp decodes the merged rows with the adapter and every plain row
    (a plain island, the question, each answer token) without it, as the torch path does."""
    from dataclasses import replace

    from ktm.core.config import LoraSettings

    model = fresh_model(tiny_model_dir, k=2, lora=LoraSettings(scope="merged"), plain_prefix=1)
    perturb(model)
    model.save(tmp_path / "ckpt")
    torch_model = KTMModel.load(tmp_path / "ckpt")
    export_gguf(torch_model, tmp_path / "export", source=tmp_path / "ckpt")
    folded = read_manifest(tmp_path / "export")["model_gguf"]
    assert folded["lora"].startswith("none")  # the base alone, the adapter run beside it
    llama = KTMModel.load(tmp_path / "ckpt", backend="llamacpp", gguf=tmp_path / "export",
                          llamacpp=EXACT)
    assert llama.runtime.files == {"model_gguf": str(tmp_path / "export" / "model.gguf"),
                                   "adapter_gguf": str(tmp_path / "export" / "adapter.gguf"),
                                   "folded_types": folded["types"]}
    units = -(-(len(torch_model.tokenize(DOC, True)) - 1) // 2)  # after the plain sink
    island = tuple(1 if 3 <= u < 6 else 2 for u in range(units))
    prompts = [[Segment(DOC), Segment(" Answer:", compress=False)],
               [Segment(DOC, levels=island), Segment(" Answer:", compress=False)]]
    want = torch_model.generate(prompts, max_new_tokens=16, stop_at_eos=False)
    assert llama.generate(prompts, max_new_tokens=16, stop_at_eos=False) == want
    with torch.no_grad():
        got = llama(prompts, [" the fox", " the dog"]).nll
        ref = torch_model(prompts, [" the fox", " the dog"]).nll
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    # the same export read by a model whose LoRA adapts every row is refused by name
    model._config = replace(model._config, lora=replace(model._config.lora, scope="all"))
    model.save(tmp_path / "all-rows")
    with pytest.raises(KTMError, match="lora_scope: export 'merged', model 'all'"):
        KTMModel.load(tmp_path / "all-rows", backend="llamacpp", gguf=tmp_path / "export",
                      llamacpp=EXACT)


def test_a_base_model_is_exported_once_whatever_its_untrained_lora_drew(tiny_model_dir):
    """A base model opened as a reader has a LoRA whose B are zero and whose A are drawn at
    random: it adds nothing, so each opening keys the same cached export (llama.cpp and vLLM);
    a LoRA that adds something keys another."""
    from ktm.llamacpp.export import export_key
    from ktm.vllm.backend import export_key as vllm_key

    first = KTMModel.from_base(tiny_model_dir, k=4, use_mlp=False)
    torch.manual_seed(123)
    again = KTMModel.from_base(tiny_model_dir, k=4, use_mlp=False)
    a = next(p for n, p in again.peft.named_parameters() if "lora_A" in n)
    assert not torch.equal(a, next(p for n, p in first.peft.named_parameters()
                                   if "lora_A" in n))
    for key in (export_key, vllm_key):
        assert key(first) == key(again)
        perturb(again)
        assert key(first) != key(again)
        again = KTMModel.from_base(tiny_model_dir, k=4, use_mlp=False)
