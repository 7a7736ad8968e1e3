"""Builders the tests share: tiny tokenizers and models made in-process, prompts, perturbations.

Imported as ``from helpers import ...`` (``tests/`` is on the path through its conftest).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import transformers as T
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from ktm import Segment
from ktm.decode.batched import join, keep_rows
from ktm.decode.generate import advance, prefill
from ktm.model import KTMModel, trainable_parameters

CORPUS = [
    "Tree: AB\n+CD\n++EF, Task: Parent/Child Relationship, Parent: AB, Child: CD, Answer: true",
    "Review: These shoes fit well and look great, Label: positive negative false",
    "def add(a, b):\n    return a + b\n# Update the old python code content",
    "The quick brown fox jumps over the lazy dog. Hello world, my name is ktm.",
]


IN_CI = os.environ.get("CI", "").lower() == "true"


def skip_unless_ci(why: str) -> None:
    """A test needs something this install lacks: skip it on a development install, but fail
    under CI, whose test command installs everything a test needs (a skip there would pass a
    test unseen)."""
    if IN_CI:
        pytest.fail(f"{why}; CI installs it", pytrace=False)
    pytest.skip(why)


def require_module(name: str, why: str) -> None:
    """``skip_unless_ci`` for a module that is not installed."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        skip_unless_ci(why)


def build_tokenizer(bos: bool = False, eos: bool = False) -> PreTrainedTokenizerFast:
    """``bos``: the tokenizer puts <bos> before every text, as Llama 3's or Gemma's does;
    ``eos``: it puts <eos> after every text, as Llama 2's with ``add_eos_token`` does."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<eos>"] + ["<bos>"] * bos,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    if bos or eos:
        single = "<bos> " * bos + "$A" + " <eos>" * eos
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {single.replace('$A', '$B')}",
            special_tokens=[(t, tok.token_to_id(t)) for t in ("<bos>", "<eos>") if t in single])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   model_max_length=512, **({"bos_token": "<bos>"} if bos else {}))


def sentencepiece_like_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer that puts a space before every text it is given (SentencePiece's dummy prefix,
    a ``Metaspace`` pre-tokenizer in the fast tokenizers of Llama 2 and Mistral)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def legacy_sentencepiece_tokenizers() -> dict:
    """Tokenizers that put the dummy space before a text even after a special token, so none can
    anchor a later segment: a ``legacy=True`` Llama tokenizer (Metaspace ``prepend_scheme=
    "always"``) and a Llama-2 ``tokenizer.json`` (a ``Prepend("▁")`` normalizer)."""

    from tokenizers import Tokenizer, normalizers
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    sp = sentencepiece_like_tokenizer()
    state = json.loads(sp.backend_tokenizer.to_str())["model"]
    legacy = LlamaTokenizer(vocab=state["vocab"], merges=[tuple(m) for m in state["merges"]],
                            legacy=True)
    backend = Tokenizer.from_str(sp.backend_tokenizer.to_str())
    backend.pre_tokenizer = None
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
    prepend = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                      eos_token="</s>", unk_token="<unk>")
    return {"legacy": legacy, "prepend": prepend}


def save_tiny_llama(path, bos: bool = False, eos: bool = False) -> str:
    tok = build_tokenizer(bos, eos)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    # random init is tiny; scale up so logits differ enough for generation tests to be meaningful
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def fresh_model(model_dir: str, k: int = 4, **kw):
    """A new KTMModel on ``model_dir``, its fresh weights drawn at seed 0."""
    from ktm.model import KTMModel

    torch.manual_seed(0)
    return KTMModel.from_base(model_dir, k=k, **kw)


TEXT = "The quick brown fox jumps over the lazy dog. Hello world, my name is ktm."


PROMPTS = [
    TEXT,
    [Segment("Tree: AB\n+CD\n++EF"), Segment(", Parent: AB, Child: CD, Answer: ", compress=False)],
    "Hello world",
]


TARGETS = ["true", "false", "positive review"]


# ---------------------------------------------------------------- the device the parity tests use
# ``KTM_TEST_DEVICE`` (default cpu; cuda on a GPU machine) and ``KTM_TEST_DTYPE`` (the base LM's
# dtype, default float32) pick where the device-aware tests run: tests/test_layout_parity.py,
# tests/test_on_device.py and tests/core/test_context_on_device.py.
DEVICE = os.environ.get("KTM_TEST_DEVICE", "cpu")
DTYPE = os.environ.get("KTM_TEST_DTYPE", "float32")
# norm-wise relative tolerance of a tensor comparison, ||a - b|| / ||b||: in fp32 another kernel
# for another shape sums in another order; bf16 keeps 8 bits of mantissa (1e-2 seen on the CPU).
# A wrong mask, position or read past a block is off by order 1.
NORM_TOL = {"float32": 1e-5, "bfloat16": 5e-2, "float16": 1e-2}


def require_device() -> None:
    """Fail (never skip) when the device asked for is not there: a GPU run that silently fell
    back to nothing would pass unseen."""
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.fail(f"KTM_TEST_DEVICE={DEVICE!r} asked for, but torch sees no CUDA device",
                    pytrace=False)


def close(a: torch.Tensor, b: torch.Tensor, tol: float | None = None) -> None:
    """``a`` equals ``b`` up to the norm-wise relative ``tol`` (default: the test dtype's)."""
    tol = NORM_TOL[DTYPE] if tol is None else tol
    assert a.shape == b.shape, (a.shape, b.shape)
    a, b = a.double(), b.double()
    off = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert off <= tol, f"relative difference {off:.2e}, more than {tol:.0e}"


def perturb(model: KTMModel, seed: int = 0) -> None:
    """Give LoRA and the encoder non-trivial weights (both start as no-ops). The noise is drawn
    on the CPU, so a model on any device or dtype gets the same weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in trainable_parameters(model):
            p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.device, p.dtype))


def zero_lora(model: KTMModel) -> KTMModel:
    """``model`` with its LoRA's B zeroed: every row read by the base LM, what vLLM serves for a
    LoRA of the merged rows (``ktm.vllm.export.LORA_ROWS``). Before any forward, so no folded
    weight holds the old LoRA."""
    with torch.no_grad():
        for name, p in model.peft.named_parameters():
            if "lora_B" in name:
                p.zero_()
    return model


LAYERS = 2


LLAMA = {n: LAYERS for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj")}


ATTENTION = {n: LAYERS for n in ("q_proj", "k_proj", "v_proj", "o_proj")}


NEOX = {n: LAYERS for n in ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")}


MOE = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}


# family -> (config class, extra config fields, modules LoRA must cover: name -> count)
FAMILIES = {
    "llama": (T.LlamaConfig, {}, LLAMA),
    "qwen2": (T.Qwen2Config, {}, LLAMA),
    "qwen3": (T.Qwen3Config, {}, LLAMA),
    "gemma": (T.GemmaConfig, {}, LLAMA),
    "gemma2": (T.Gemma2Config, {"final_logit_softcapping": 2.0}, LLAMA),
    "mistral": (T.MistralConfig, {}, LLAMA),
    # the experts are fused 3-D parameters, not linear modules: LoRA on the attention only
    "mixtral": (T.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}, ATTENTION),
    "phi3": (T.Phi3Config, {}, {"qkv_proj": LAYERS, "o_proj": LAYERS, "gate_up_proj": LAYERS,
                                "down_proj": LAYERS}),
    "olmo2": (T.Olmo2Config, {}, LLAMA),
    "cohere": (T.CohereConfig, {"logit_scale": 0.25}, LLAMA),
    "granite": (T.GraniteConfig, {"logits_scaling": 4.0, "embedding_multiplier": 2.0}, LLAMA),
    "gpt2": (T.GPT2Config, {}, {"c_attn": LAYERS, "c_proj": 2 * LAYERS, "c_fc": LAYERS}),
    "opt": (T.OPTConfig, {}, {"q_proj": LAYERS, "k_proj": LAYERS, "v_proj": LAYERS,
                              "out_proj": LAYERS, "fc1": LAYERS, "fc2": LAYERS}),
    "gemma3_text": (T.Gemma3TextConfig, {"sliding_window": 8, "final_logit_softcapping": 2.0},
                    LLAMA),
    "smollm3": (T.SmolLM3Config, {"no_rope_layer_interval": 2}, LLAMA),
    "olmo": (T.OlmoConfig, {}, LLAMA),
    "stablelm": (T.StableLmConfig, {"num_key_value_heads": 2}, LLAMA),
    "exaone4": (T.Exaone4Config, {"sliding_window": 8, "sliding_window_pattern": 2}, LLAMA),
    "cohere2": (T.Cohere2Config, {"sliding_window": 8}, LLAMA),
    # not in ktm.core.lora.TARGETS: every linear layer but the head
    "gpt_neox": (T.GPTNeoXConfig, {}, NEOX),
    "falcon": (T.FalconConfig, {}, NEOX),  # rotary
    "bloom": (T.BloomConfig, {}, NEOX),  # ALiBi: no position ids (spread positions refused)
    "gptj": (T.GPTJConfig, {"rotary_dim": 8}, {n: LAYERS for n in (
        "q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out")}),
    "codegen": (T.CodeGenConfig, {"rotary_dim": 8}, {n: LAYERS for n in (
        "qkv_proj", "out_proj", "fc_in", "fc_out")}),
    "gpt_bigcode": (T.GPTBigCodeConfig, {}, {"c_attn": LAYERS, "c_proj": 2 * LAYERS,
                                             "c_fc": LAYERS}),
    "phi": (T.PhiConfig, {}, {n: LAYERS for n in ("q_proj", "k_proj", "v_proj", "dense", "fc1",
                                                  "fc2")}),
    "starcoder2": (T.Starcoder2Config, {}, {n: LAYERS for n in (
        "q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")}),
    "glm": (T.GlmConfig, {}, {n: LAYERS for n in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_up_proj", "down_proj")}),
    # the routed experts are fused 3-D parameters: LoRA on the shared expert's linear layers
    "qwen2_moe": (T.Qwen2MoeConfig, MOE | {"shared_expert_intermediate_size": 64},
                  LLAMA | {"shared_expert_gate": LAYERS}),
    "qwen3_moe": (T.Qwen3MoeConfig, MOE, ATTENTION),
    # PEFT would move gate/up/down_proj onto the fused experts: LoRA on the (MLA) attention only
    "deepseek_v3": (T.DeepseekV3Config, {
        "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 16, "num_key_value_heads": 4, "head_dim": 8}, {n: LAYERS for n in (
            "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}),
    # the router is an nn.Linear returning a tuple: not adapted, LoRA on the attention only
    "phimoe": (T.PhimoeConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}, ATTENTION),
    "llama4_text": (T.Llama4TextConfig, {"num_local_experts": 4}, LLAMA),  # + shared expert
    # a Mamba hybrid without positional encoding (spread positions refused); its mixers read
    # dt_proj.weight directly, so LoRA there would never train
    "jamba": (T.JambaConfig, {"num_experts": 2, "num_experts_per_tok": 1, "attn_layer_period": 2,
                              "attn_layer_offset": 1, "expert_layer_period": 2,
                              "expert_layer_offset": 1, "mamba_d_state": 8, "mamba_dt_rank": 8,
                              "use_mamba_kernels": False},
              {n: 1 for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj", "in_proj", "x_proj", "out_proj")}),
    # a Mamba hybrid: PEFT refuses LoRA on its mixers' out_proj (and conv1d)
    # its forward scales looked-up ids by embedding_multiplier, not inputs_embeds
    "falcon_h1": (T.FalconH1Config, {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8,
                                     "mamba_d_state": 8, "mamba_chunk_size": 16,
                                     "embedding_multiplier": 3.0},
                  LLAMA | {"in_proj": LAYERS}),
}


def tiny_config(family: str, vocab: int, positions: int = 256):
    cls, extra, _ = FAMILIES[family]
    common = dict(vocab_size=vocab, pad_token_id=0, eos_token_id=1, bos_token_id=None, **extra)
    if family in ("gpt2", "gpt_bigcode", "gptj", "codegen"):
        return cls(n_embd=64, n_layer=LAYERS, n_head=4, n_positions=positions, **common)
    if family in ("falcon", "bloom"):
        return cls(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, **common)
    if family == "opt":
        return cls(hidden_size=64, ffn_dim=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                   word_embed_proj_dim=64, max_position_embeddings=positions, **common)
    if family in ("gpt_neox", "phi", "stablelm", "starcoder2"):
        return cls(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                   num_attention_heads=4, max_position_embeddings=positions, **common)
    return cls(**{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                  "max_position_embeddings": positions, **common})


def save_tiny(family: str, path, positions: int = 256):
    tok = build_tokenizer()
    torch.manual_seed(0)
    base = T.AutoModelForCausalLM.from_config(tiny_config(family, len(tok), positions))
    with torch.no_grad():  # random init is tiny; larger weights make logits differ clearly
        for p in base.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    base.save_pretrained(path)
    tok.save_pretrained(path)
    return T.AutoModelForCausalLM.from_pretrained(path).eval(), tok


def decode_rejoining(model, cps, first: list[int], n_new: int) -> list[list[int]]:
    """Greedy ids per prompt when rows ``first`` start, the rest join at step 3 and each row is
    dropped once it has ``n_new`` tokens: the server's continuous batching, driven by hand."""
    later = [i for i in range(len(cps)) if i not in first]
    out: dict[int, list[int]] = {i: [] for i in range(len(cps))}
    state, rows = prefill(model, [cps[i] for i in first]), list(first)
    for step in range(n_new + 4):
        if step == 3:  # rows arrive mid-decode, some longer than anything running
            state = join(state, prefill(model, [cps[i] for i in later]))
            rows += later
        tok = state.logits.argmax(-1)
        for r, t in zip(rows, tok.tolist()):
            out[r].append(t)
        keep = [i for i, r in enumerate(rows) if len(out[r]) < n_new]
        if len(keep) < len(rows):
            keep_rows(state, keep)
            rows, tok = [rows[i] for i in keep], tok[keep]
        if not rows:
            break
        advance(model, state, tok)
    return [out[i] for i in range(len(cps))]


def byte_fallback_tokenizer():
    """SentencePiece with byte fallback (Llama 2, Mistral): a character missing from the
    vocabulary is written as its UTF-8 bytes, one ``<0xNN>`` token each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581ok": 257}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


PROMPT = [Segment("Tree: AB\n+CD\n++EF\n+GH"), Segment(", Parent: AB, Answer:", compress=False)]


def assert_one_step_lowers(model, loss_of) -> None:
    """One AdamW step (lr 2e-3) on the trainable parameters lowers ``loss_of()`` (a scalar
    tensor of ``model``'s loss on fixed inputs) by more than 1e-3."""
    from ktm.training.train import adamw

    model.train()
    before = loss_of()
    opt = adamw([p for _, p in trainable_parameters(model)], lr=2e-3)
    before.backward()
    opt.step()
    with torch.no_grad():
        after = loss_of()
    assert after.item() < before.item() - 1e-3, (before.item(), after.item())


def loss_and_grads(model: KTMModel, prompts, targets, compiled: bool):
    """A training step's loss and LoRA / encoder gradients, through the compiled decoder layers
    (``ktm.training.compiled.compiled_body``) or eager."""
    from ktm.training.compiled import compiled_body

    model.zero_grad(set_to_none=True)
    with compiled_body(model, compiled):
        out = model(prompts, targets)
        out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in trainable_parameters(model)
                               if p.grad is not None}


def trains_compiled_as_eager(model: KTMModel, prompts, targets, eager: tuple[str, ...] = ()
                             ) -> None:
    """A training step through the compiled decoder layers gives eager's loss and gradients, and
    ran compiled: every decoder layer entered its class's compiled forward, but for the classes
    named in ``eager`` (ones inductor cannot compile, which train eager).

    The step runs under torch's recompile limit set to 1 and made to raise when hit: past its
    limit torch would run a layer eagerly without a word, so the compiled body must lift the
    limit itself for a second graph (a batch of one, say). Compiled runs are
    counted in torch's profiler, where dynamo marks each run of a compiled frame
    ("Torch-Compiled Region: <compile id>"); the compile ids of a layer class's forward are
    those of the graphs dynamo holds for its code. A graph break inside a layer (the LoRA gate
    of ``ktm.core.lora_scope`` reads a ContextVar, which dynamo cannot trace) runs the rest of
    the layer as further compiled frames, not counted here."""
    from collections import Counter

    import torch._dynamo.config as dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from ktm.training import compiled

    want, want_grads = loss_and_grads(model, prompts, targets, False)
    with dynamo.patch(recompile_limit=1, fail_on_recompile_limit_hit=True), \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got, grads = loss_and_grads(model, prompts, targets, True)
    close(got, want)
    assert grads.keys() == want_grads.keys() and grads
    for name, g in grads.items():
        close(g, want_grads[name])
    layers = compiled.decoder_layers(model)
    kinds = {type(layer) for layer in layers}
    assert sorted(c.__name__ for c in kinds if compiled._COMPILED[c] is c.forward) == sorted(
        eager), "the layer classes that train eager"
    events, region = prof.events(), "Torch-Compiled Region: "
    runs = Counter(e.name.removeprefix(region) for e in events if e.name.startswith(region))
    # layers per forward code object: two classes may share one
    want_runs = Counter(type(layer).forward.__code__ for layer in layers
                        if type(layer).__name__ not in eager)
    got_runs = {code: sum(runs[str(entry.compile_id)]
                          for entry in _debug_get_cache_entry_list(code)) for code in want_runs}
    assert got_runs == dict(want_runs), {code.co_qualname: f"{got_runs[code]} compiled runs of "
                                         f"{n} layers" for code, n in want_runs.items()}
    backward = sum(e.name == "CompiledFunctionBackward" for e in events)
    assert backward >= sum(want_runs.values()), f"{backward} compiled backward runs"


@contextmanager
def opens_under(folder):
    """Counts, per file under ``folder`` (relative name), the opens within the block: Python's
    ``open`` (JSON), seen by an audit hook (hooks cannot be removed: this one goes quiet when
    the block ends), and safetensors' (its Rust reader opens no Python file: its one Python
    entry, ``safetensors.torch.safe_open``, is counted)."""
    import safetensors.torch

    root = os.path.realpath(folder)
    counts: Counter[str] = Counter()
    live = True

    def note(path) -> None:
        path = os.path.realpath(os.fspath(path))
        if live and path.startswith(root + os.sep):
            counts[os.path.relpath(path, root)] += 1

    sys.addaudithook(lambda event, args: event == "open" and isinstance(args[0], (str, bytes,
                     os.PathLike)) and note(args[0]))
    real = safetensors.torch.safe_open

    def counted(filename, *args, **kwargs):
        note(filename)
        return real(filename, *args, **kwargs)

    try:
        with mock.patch.object(safetensors.torch, "safe_open", counted):
            yield counts
    finally:
        live = False
