"""``ktm export --format vllm`` and ``ktm.vllm.client`` on the tiny model (vLLM itself
needs a GPU; a stub server stands in for it, decoding the payload the way vLLM documents)."""

import base64
import io
import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from helpers import PROMPT, PROMPTS, fresh_model, perturb, zero_lora
from transformers import AutoModelForCausalLM

from ktm import KTMError
from ktm.core.config import LoraSettings
from ktm.model import KTMModel, prompt_logits
from ktm.vllm.client import VLLMClient, encode_embeds
from ktm.vllm.export import LORA_ROWS, export_vllm, read_manifest


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4, plain_prefix=1, plain_suffix=2,
                               align_lines=True)
    perturb(model, seed=1)  # LoRA and the encoder away from their no-op starts
    return model


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "x"
    export_vllm(trained, out)
    return out


def test_exported_lm_loads_in_transformers_with_equal_logits(trained, exported):
    before = prompt_logits(trained, PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(exported / "lm").eval()
    assert not any("lora" in n for n, _ in hf.named_parameters())
    client = VLLMClient(exported)
    with torch.no_grad():
        for prompt in PROMPTS + [PROMPT]:
            cp, want = client.encode(prompt), trained.compress(prompt)
            torch.testing.assert_close(cp.embeds, want.embeds, atol=1e-6, rtol=1e-5)
            assert (cp.tokens_in, cp.tokens_out) == (want.tokens_in, want.tokens_out)
            got = hf(inputs_embeds=cp.embeds[None]).logits[0]
            torch.testing.assert_close(got, prompt_logits(trained, prompt), atol=1e-5, rtol=1e-5)
    # the export merged a copy: the model still has its adapter and its outputs
    torch.testing.assert_close(prompt_logits(trained, PROMPT), before, atol=0, rtol=0)
    m = read_manifest(exported)
    assert m["k"] == 4 and (m["plain_prefix"], m["plain_suffix"], m["align_lines"]) == (1, 2, True)
    assert m["served_model_name"].startswith("ktm-k4-")


def test_a_lora_of_the_merged_rows_is_served_without_it(tiny_model_dir, tmp_path):
    """vLLM applies a weight to every row of a request, so a LoRA that adapts the merged rows
    only is exported without it: the served LM reads the prompt as the same model with its
    LoRA zeroed, and the manifest says so; the model keeps its LoRA."""
    def gated_model():
        model = fresh_model(tiny_model_dir, lora=LoraSettings(scope="merged"))
        perturb(model, seed=1)
        return model

    model, zeroed = gated_model(), zero_lora(gated_model())
    before = prompt_logits(model, PROMPT)
    assert not torch.allclose(before, prompt_logits(zeroed, PROMPT), atol=1e-4)  # it adapts
    export_vllm(model, tmp_path / "x")
    assert read_manifest(tmp_path / "x")["lora_rows"] == LORA_ROWS["merged"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "x" / "lm").eval()
    client = VLLMClient(tmp_path / "x")
    with torch.no_grad():
        for prompt in PROMPTS + [PROMPT]:
            got = hf(inputs_embeds=client.encode(prompt).embeds[None]).logits[0]
            torch.testing.assert_close(got, prompt_logits(zeroed, prompt), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prompt_logits(model, PROMPT), before, atol=0, rtol=0)


def test_payload_round_trips_through_torch_load_weights_only(exported):
    client = VLLMClient(exported)
    body = json.loads(json.dumps(client.payload(PROMPT, max_tokens=5, stop=["\n"], seed=3)))
    assert "prompt" not in body and body["model"] == client.model_name
    raw = base64.b64decode(body["prompt_embeds"], validate=True)
    embeds = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    want = client.encode(PROMPT).embeds
    assert embeds.dtype == want.dtype and embeds.shape == want.shape
    assert torch.equal(embeds, want)
    assert len(raw) < 2 * want.nbytes + 2048  # the tensor itself, not a larger storage
    half = torch.load(io.BytesIO(base64.b64decode(encode_embeds(want[:2].half()))),
                      weights_only=True)
    assert half.dtype == torch.float16 and half.shape == (2, want.shape[1])


class StubVLLM(BaseHTTPRequestHandler):
    """/v1/models and /v1/completions with prompt_embeds, answered by the exported HF LM."""

    served: list[str] = []
    lm = None
    tokenizer = None
    bodies: list[dict] = []
    answer: bytes | None = None  # sent as is to a completion, when set (a proxy's page)
    delay = 0.0  # seconds before answering a completion

    def log_message(self, *args):
        pass

    def _send(self, obj, code=200):
        data = json.dumps(obj, ensure_ascii=False).encode()  # as vLLM's FastAPI answers
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": n, "object": "model", "max_model_len": 512}
                                               for n in self.served]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if body["model"] not in self.served:
            return self._send({"error": {"message": "model not found"}}, 404)
        time.sleep(self.delay)
        if self.answer is not None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.answer)))
            self.end_headers()
            return self.wfile.write(self.answer)
        if body["max_tokens"] > 512:  # vLLM's answer is long and need not be ASCII
            return self._send({"error": {"message": "é" * 600}}, 400)  # byte 1000: mid-é
        raw = base64.b64decode(body["prompt_embeds"], validate=True)
        embeds = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        with torch.no_grad():
            out = self.lm.generate(inputs_embeds=embeds[None], do_sample=False,
                                   max_new_tokens=body["max_tokens"], pad_token_id=0)
        ids = out[0].tolist()
        eos = self.tokenizer.eos_token_id
        ids = ids[: ids.index(eos)] if eos in ids else ids
        self._send({"choices": [{"index": 0, "text": self.tokenizer.decode(
            ids, skip_special_tokens=True), "finish_reason": "length"}]})


@pytest.fixture
def stub(exported):
    from transformers import AutoTokenizer

    StubVLLM.lm = AutoModelForCausalLM.from_pretrained(exported / "lm").eval()
    StubVLLM.tokenizer = AutoTokenizer.from_pretrained(exported / "lm")
    StubVLLM.served = [read_manifest(exported)["served_model_name"]]
    StubVLLM.bodies = []
    StubVLLM.answer, StubVLLM.delay = None, 0.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubVLLM)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_client_completion_through_a_vllm_shaped_server_equals_generate(trained, exported, stub):
    client = VLLMClient(exported, stub)
    for prompt in (PROMPT, PROMPTS[0]):
        assert client.complete(prompt, max_tokens=8) == trained.generate(prompt,
                                                                          max_new_tokens=8)
    assert client.server_checked and len(StubVLLM.bodies) == 2


def test_client_reports_a_long_non_ascii_error_of_the_server(exported, stub):
    client = VLLMClient(exported, stub)
    with pytest.raises(KTMError, match=r"answered 400: \{\"error\": \{\"message\": \"é"):
        client.complete(PROMPT, max_tokens=1000)


def test_client_reports_an_answer_that_is_not_a_completion(exported, stub):
    """A proxy's HTML page, JSON of another shape, no answer in time: one KTMError naming
    what came back (a raw JSONDecodeError, KeyError or TimeoutError before)."""
    client = VLLMClient(exported, stub)
    for answer, match in [(b"<html>502 Bad Gateway</html>", r"answered b'<html>502 Bad Gateway"
                                                            r"</html>': expected a JSON object"),
                          (b"[1, 2]", r"answered b'\[1, 2\]': expected a JSON object"),
                          (b'{"choices": []}', r"answered \{\"choices\": \[\]\}: expected a "
                                               r"completion")]:
        StubVLLM.answer = answer
        with pytest.raises(KTMError, match=match):
            client.complete(PROMPT, max_tokens=2)
    StubVLLM.delay = 1.0
    client.timeout = 0.2
    with pytest.raises(KTMError, match=r"did not answer within 0.2 s"):
        client.complete(PROMPT, max_tokens=2)


def test_client_refuses_a_server_serving_another_model(exported, stub):
    StubVLLM.served = ["meta-llama/Llama-3.2-1B-Instruct"]
    client = VLLMClient(exported, stub)
    with pytest.raises(KTMError, match=r"serves \['meta-llama/Llama-3.2-1B-Instruct'\], not "
                                       r"this export's 'ktm-k4-"):
        client.complete(PROMPT, max_tokens=2)
    assert StubVLLM.bodies == []  # refused before sending anything


def test_client_refuses_an_encoder_from_another_export(tiny_model_dir, exported, tmp_path):
    torch.manual_seed(1)
    other = KTMModel.from_base(tiny_model_dir, k=4, plain_prefix=1)
    perturb(other, seed=7)
    export_vllm(other, tmp_path / "other")
    mixed = tmp_path / "mixed"
    shutil.copytree(exported, mixed)
    shutil.copy(tmp_path / "other" / "encoder.safetensors", mixed / "encoder.safetensors")
    with pytest.raises(KTMError, match="encoder files .* not the ones this export"):
        VLLMClient(mixed)
    shutil.copy(exported / "encoder.safetensors", mixed / "encoder.safetensors")
    shutil.copy(tmp_path / "other" / "lm" / "model.safetensors", mixed / "lm")
    with pytest.raises(KTMError, match="lm files .* base model / encoder mismatch"):
        VLLMClient(mixed)
    assert read_manifest(tmp_path / "other")["served_model_name"] != read_manifest(
        exported)["served_model_name"]


def test_export_cli_and_its_errors(capsys, tiny_model_dir, trained, tmp_path):
    from ktm.cli.main import main

    ckpt = tmp_path / "ck"
    trained.save(str(ckpt))
    assert main(["export", "--format", "vllm", str(tmp_path / "e"), "--model", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "--enable-prompt-embeds" in out and read_manifest(tmp_path / "e")["k"] == 4
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "notes.txt").write_text("mine")
    for argv, match in [
        ([str(tmp_path / "occupied"), "--model", str(ckpt)], "is not a ktm export"),
        ([str(tmp_path / "f"), "--model", str(ckpt), "--k", "2"], "K=4"),
        ([str(tmp_path / "g"), "--model", "no-such-model"], "unknown model"),
        # a base model's --k 0 once exported K=4 (the default), silently
        ([str(tmp_path / "h"), "--model", tiny_model_dir, "--k", "0"], "k must be an integer "
                                                                       ">= 1, got 0"),
    ]:
        assert main(["export", *argv]) == 2
        assert match in capsys.readouterr().err
        assert argv[0].endswith("occupied") or not Path(argv[0]).exists()
    with pytest.raises(KTMError, match="not a ktm vLLM export"):
        VLLMClient(tmp_path / "occupied")


def test_export_of_a_model_whose_input_embeddings_are_narrower_than_its_hidden_states(tmp_path):
    """OPT-350m projects its 512-wide input embeddings to 1024 inside the model: the encoder,
    the embedding table and prompt_embeds are all as wide as the embeddings, not the LM."""
    import transformers as T
    from helpers import build_tokenizer, tiny_config

    tok = build_tokenizer()
    cfg = tiny_config("opt", len(tok))
    cfg.word_embed_proj_dim = 32
    torch.manual_seed(0)
    model = KTMModel.from_base(T.AutoModelForCausalLM.from_config(cfg), k=4, tokenizer=tok)
    perturb(model, seed=1)
    m = export_vllm(model, tmp_path / "opt")
    assert (m["hidden_size"], m["embedding_size"], m["encoder"]["hidden_size"]) == (64, 32, 32)
    client = VLLMClient(tmp_path / "opt")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "opt" / "lm").eval()
    with torch.no_grad():
        cp = client.encode(PROMPT)
        assert cp.embeds.shape[1] == 32
        torch.testing.assert_close(hf(inputs_embeds=cp.embeds[None]).logits[0],
                                   prompt_logits(model, PROMPT), atol=1e-5, rtol=1e-5)


def test_export_refuses_a_model_whose_embedding_layer_scales_its_output(tmp_path):
    """Gemma's embedding layer multiplies the table rows by sqrt(hidden): ktm merges those scaled
    vectors, while the client builds prompt_embeds from the raw table and vLLM's Gemma scales
    prompt_embeds itself; the served prefix would not be the one the model was trained on."""
    from helpers import save_tiny

    base, tok = save_tiny("gemma", tmp_path / "gemma")
    model = KTMModel.from_base(base, k=4, tokenizer=tok)
    with pytest.raises(KTMError, match=r"'gemma' LM's embedding layer scales the table rows "
                                       r"\(x8\.00\)"):
        export_vllm(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_refuses_a_model_with_ltsc_meta_rows(tiny_model_dir, tmp_path):
    from ktm.compressors.ltsc import add_meta_tokens

    model = KTMModel.from_base(tiny_model_dir, k=4)
    add_meta_tokens(model, [[5, 6, 7]])
    with pytest.raises(KTMError, match="LTSC meta-token rows"):
        export_vllm(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_refuses_a_model_trained_with_spread_positions(tiny_model_dir, tmp_path, capsys):
    # README, "Serving on vLLM": vLLM puts prompt_embeds at consecutive positions, so a model
    # whose merged blocks take their last token's position (the shipped readers) is refused
    from ktm.cli.main import main

    model = KTMModel.from_base(tiny_model_dir, k=4, spread_positions=True)
    with pytest.raises(KTMError,
                       match="spread_positions.*consecutive positions.*smollm2-135m-k4-seq"):
        export_vllm(model, tmp_path / "x")
    model.save(tmp_path / "ckpt")
    assert main(["export", "--format", "vllm", str(tmp_path / "y"),
                 "--model", str(tmp_path / "ckpt")]) == 2
    assert "spread_positions" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.parametrize("context", [dict(context_blocks=2), dict(context_transformer=1)])
def test_the_client_merges_as_the_model_with_a_contextual_encoder(tiny_model_dir, tmp_path,
                                                                  context):
    # (c) and (b) contextual merging keep the encoder contract: the export carries their weights
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=2, **context)
    perturb(model, seed=2)
    assert all(p.any() for p in model.encoder.context_parameters())
    export_vllm(model, tmp_path / "x")
    client = VLLMClient(tmp_path / "x")
    for prompt in PROMPTS:
        with torch.no_grad():
            want = model.encode_prompts([prompt])[0].embeds
        torch.testing.assert_close(client.encode(prompt).embeds, want)


@pytest.mark.parametrize("family,pool", [("llama", "mean"), ("qwen2", "query"),
                                         ("gpt2", "mean")])
def test_the_client_runs_the_base_lms_first_layers_for_an_encoder_that_reads_them(
        family, pool, tmp_path):
    """(a) ``context_layers``: the served LM has the LoRA merged into every layer, so the export
    carries the base's own first L layers (adapter-free) and the client runs them."""
    from helpers import save_tiny

    save_tiny(family, tmp_path / family)
    torch.manual_seed(0)
    model = KTMModel.from_base(str(tmp_path / family), k=2, context_layers=1, context_pool=pool)
    perturb(model, seed=2)  # a LoRA the context layers must not see
    assert all(p.any() for p in model.encoder.context_parameters())
    m = export_vllm(model, tmp_path / "x")
    assert m["context_lm"]["layers"] == 1
    client = VLLMClient(tmp_path / "x")
    for prompt in PROMPTS:
        with torch.no_grad():
            want = model.encode_prompts([prompt])[0].embeds
        torch.testing.assert_close(client.encode(prompt).embeds, want)
    # the copied layers are checked like the LM's files
    weights = next((tmp_path / "x" / "context_lm").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(KTMError, match="not the ones this export was made with"):
        VLLMClient(tmp_path / "x")


def test_payload_sends_neutral_values_for_what_vllm_takes_from_generation_config(exported):
    """vLLM (its default ``--generation-config auto``) fills a sampling option a request leaves
    out from the LM's generation_config.json (Qwen2.5-Instruct's top_k 20, repetition_penalty
    1.05), while ktm samples with temperature and top_p only: the client sends every option
    vLLM reads from there, at the value that decodes as ktm does."""
    body = VLLMClient(exported).payload(PROMPT, temperature=0.5, top_p=0.9)
    # the options vLLM's ModelConfig.get_diff_sampling_param reads from generation_config.json
    assert {k: body.get(k) for k in ("temperature", "top_p", "top_k", "min_p",
                                     "repetition_penalty")} == {
        "temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def test_export_refuses_a_loaded_checkpoint_of_a_baseline_that_rewrites_prompts(trained,
                                                                                tmp_path):
    """``ktm export`` refuses such a checkpoint by its folder; ``export_vllm`` on the model
    ``KTMModel.load`` built from it must too (it carries the checkpoint's compressor.json)."""
    from ktm.compressors.record import write_record

    trained.save(tmp_path / "sc")
    write_record(tmp_path / "sc", "selective_context", {})
    with pytest.raises(KTMError, match="--compressor selective_context .*reads prompts as "
                                       "selective_context rewrote them"):
        export_vllm(KTMModel.load(tmp_path / "sc"), tmp_path / "x")
    assert not (tmp_path / "x").exists()
    write_record(tmp_path / "sc", "mean_pool", {})  # only an encoder setting: the same model
    assert export_vllm(KTMModel.load(tmp_path / "sc"), tmp_path / "x")["k"] == 4


def test_export_refuses_an_output_folder_inside_or_holding_the_model_folder(capsys, trained,
                                                                             tmp_path):
    """An export inside the checkpoint would vanish at the checkpoint's next (whole-folder)
    save; an export over a folder that holds the model's would delete it."""
    from ktm.cli.main import main

    ckpt = tmp_path / "ck"
    trained.save(ckpt)
    files = sorted(p.name for p in ckpt.rglob("*"))
    assert main(["export", str(ckpt / "vllm"), "--model", str(ckpt)]) == 2
    assert f"output folder {str(ckpt / 'vllm')!r} is inside the model folder" in (
        capsys.readouterr().err)
    assert sorted(p.name for p in ckpt.rglob("*")) == files
    export_vllm(trained, tmp_path / "e")
    lm = tmp_path / "e" / "lm"  # a base model read from inside a previous export
    with pytest.raises(KTMError, match=f"{str(tmp_path / 'e')!r} holds the model folder"):
        export_vllm(KTMModel.from_base(str(lm), k=4), tmp_path / "e")
    assert (lm / "model.safetensors").is_file()
    with pytest.raises(KTMError, match="is inside the model folder"):
        export_vllm(KTMModel.from_base(str(lm), k=4), lm / "again")


def test_client_refuses_a_tokenizer_other_than_the_exported_one(exported, tmp_path):
    """The client tokenizes prompts with the tokenizer in lm/: one edited or copied from
    another model since the export would merge other ids, silently."""
    mixed = tmp_path / "mixed"
    shutil.copytree(exported, mixed)
    tok = mixed / "lm" / "tokenizer.json"
    spec = json.loads(tok.read_text())
    spec["added_tokens"] = spec["added_tokens"][:-1]  # one special token fewer
    tok.write_text(json.dumps(spec))
    with pytest.raises(KTMError, match="the tokenizer files in .* not the ones this export"):
        VLLMClient(mixed)
    # an export written before the tokenizer's sha256 checks the LM and the encoder only
    manifest = json.loads((mixed / "ktm_export.json").read_text())
    del manifest["sha256"]["tokenizer"]
    (mixed / "ktm_export.json").write_text(json.dumps(manifest))
    VLLMClient(mixed)


def test_client_refuses_a_corrupt_manifest_naming_it(exported, tmp_path):
    """A manifest that is not an object, or lacks what the client reads, was a raw
    AttributeError or KeyError."""
    broken = tmp_path / "broken"
    shutil.copytree(exported, broken)
    manifest = json.loads((broken / "ktm_export.json").read_text())
    path = broken / "ktm_export.json"
    for text, match in [("[]", "is corrupt: expected a JSON object, found list"),
                        (json.dumps({**manifest, "sha256": None}),
                         "is corrupt: 'sha256' is None, expected a JSON object"),
                        (json.dumps({k: v for k, v in manifest.items() if k != "encoder"}),
                         r"is corrupt: it lacks \['encoder'\]; re-export")]:
        path.write_text(text)
        with pytest.raises(KTMError, match=match):
            VLLMClient(broken)


def test_export_config_is_validated_on_construction(tiny_model_dir):
    """As ServeConfig: a bad K or dtype is refused before any model is loaded; load_any, which
    the API and ktm serve share, refuses a base model's K=0 too (it read it as the default)."""
    from ktm.model import load_any
    from ktm.serving.export import ExportConfig

    with pytest.raises(KTMError, match="k must be an integer >= 1, got 0"):
        ExportConfig(k=0)
    with pytest.raises(KTMError, match=r"dtype must be one of .*, got 'fp8'"):
        ExportConfig(dtype="fp8")
    with pytest.raises(KTMError, match="k must be an integer >= 1, got 0"):
        load_any(tiny_model_dir, 0)


def test_a_failed_export_leaves_the_previous_one_whole_and_no_temp(trained, tmp_path,
                                                                   monkeypatch, capsys):
    """No space left midway (the encoder file, after the LM was written): the previous export
    is intact, nothing half-written is left beside it, and the CLI says so with exit 2. An
    output path that is a file, or under one, is refused as well."""
    import errno

    import ktm.vllm.export
    from ktm.cli.main import main

    out = tmp_path / "x"
    export_vllm(trained, out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ktm.vllm.export, "save_file", no_space)
    with pytest.raises(KTMError, match=f"cannot write {str(out)!r}: .*No space left"):
        export_vllm(trained, out)
    trained.save(tmp_path / "ck")
    assert main(["export", str(out), "--model", str(tmp_path / "ck")]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "x"]
    monkeypatch.undo()
    (tmp_path / "file").write_text("mine")
    for dest, match in [(tmp_path / "file", "exists and is not a ktm export"),
                        (tmp_path / "file" / "sub", "cannot write")]:
        with pytest.raises(KTMError, match=match):
            export_vllm(trained, dest)
    assert (tmp_path / "file").read_text() == "mine"
