"""``/openapi.json``: the server's OpenAPI document, stating what it answers.

FastAPI's own document is made from the routes and the request models (``ktm.serving.protocol``);
it is then corrected where the server answers otherwise than FastAPI assumes:

- errors: a refused request gets OpenAI's error object with 400 (FastAPI's 422 is never sent),
  401 without a key where the server has one, 404 for a model not served, 413 for a body too
  large, 415 for a body that is not JSON, 503 while the server is busy or stopping;
- a completion or a chat answers JSON, or Server-Sent Events with ``"stream": true``;
- ``/metrics`` is Prometheus' text format, not JSON;
- with ``--api-key``, the ``/v1`` routes ask for it as a bearer token;
- a request of each kind the server answers is an example (schemathesis sends them first);
- the bounds a request is checked against are the exact ones: ``seed`` an int64 (FastAPI writes
  2**63 as a float, which rounds past the largest int64), ``model`` the served name,
  ``max_tokens`` at most ``--max-tokens-limit``, at most ``MAX_STOP`` stop strings.

A document made once per app and kept (``app.openapi_schema``), as FastAPI keeps its own.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ktm.serving.protocol import MAX_STOP

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
# what each kind of route may answer besides its 200, and why
WHY = {"400": "a bad request: OpenAI's error object naming the field",
       "401": "no valid API key (the server has one)",
       "404": "the model named is not served here",
       "413": "the request body is over the server's limit (--max-request-mb)",
       "415": "the body is not JSON (its Content-Type)",
       "503": "the server is busy (Retry-After) or shutting down"}
GENERATE = ("/v1/completions", "/v1/chat/completions")
DOC = "def add(a, b):\n    return a + b\n"
# requests the server answers, one of each kind, as the document's examples ("model" filled in)
EXAMPLES = {
    "/v1/completions": {
        "plain": {"prompt": DOC + "# add(2, 3) is", "max_tokens": 4, "temperature": 0},
        "segments": {"ktm": {"segments": [{"text": DOC}, {"text": "\n# It returns",
                                                         "merge": False}]}, "max_tokens": 4},
        "sampled": {"prompt": ["The museum", "A tree"], "n": 2, "seed": 7, "top_p": 0.9,
                    "logprobs": 2, "stop": ["\n"], "max_tokens": 4},
        "streamed": {"prompt": DOC, "stream": True, "stream_options": {"include_usage": True},
                     "max_tokens": 4}},
    "/v1/chat/completions": {
        "chat": {"messages": [{"role": "system", "content": "Answer briefly."},
                              {"role": "user", "content": DOC + "What does add return?"}],
                 "max_tokens": 4, "temperature": 0},
        "marked": {"messages": [{"role": "user", "content": DOC, "ktm": {"merge": False}}],
                   "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 4},
        "streamed": {"messages": [{"role": "user", "content": "Hello"}], "stream": True,
                     "max_tokens": 4}},
}
INT64 = (-2**63, 2**63 - 1)


def openapi_document(app: FastAPI) -> dict:
    """The app's OpenAPI document (the module docstring)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    cfg = app.state.cfg
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas["Error"] = ERROR
    keyed = bool(cfg.api_key)
    if keyed:  # every /v1 route asks for the key as a bearer token
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc["paths"].items():
        for op in operations.values():
            _answers(op["responses"], path, keyed)
            for param in op.get("parameters", ()):  # /v1/models/{model_id}: the one served
                if param["name"] == "model_id":
                    param["example"] = cfg.served_name
            if path in EXAMPLES:
                op["requestBody"]["content"]["application/json"]["examples"] = {
                    name: {"value": {"model": cfg.served_name, **body}}
                    for name, body in EXAMPLES[path].items()}
            if keyed and path.startswith("/v1/"):
                op["security"] = [{"bearer": []}]
    for name in ("CompletionRequest", "ChatRequest"):
        fields = schemas[name]["properties"]
        fields["model"] = {"type": "string", "enum": [cfg.served_name], "title": "Model"}
        fields["seed"]["anyOf"][0].update(minimum=INT64[0], maximum=INT64[1])
        for limit in ("max_tokens", "max_completion_tokens"):
            if limit in fields:
                fields[limit]["anyOf"][0].update(minimum=1, maximum=cfg.max_tokens_limit)
        fields["stop"]["anyOf"][1]["maxItems"] = MAX_STOP
    app.openapi_schema = doc
    return doc


def _answers(responses: dict, path: str, keyed: bool) -> None:
    """``responses`` of the route at ``path`` as the server answers them (in place)."""
    responses.pop("422", None)
    ok = responses.setdefault("200", {"description": "Successful Response"})
    if path == "/metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    if path in GENERATE:
        # each event a chunk (JSON), then "[DONE]"
        ok["content"]["text/event-stream"] = {"schema": {}}
    statuses = []
    if path.startswith("/v1/"):
        statuses += ["401"] if keyed else []
        statuses += ["503"]
    if path in GENERATE:
        statuses += ["400", "404", "413", "415"]
    if path.startswith("/v1/models/"):
        statuses += ["404"]
    if path == "/health":  # its state, as the 200 gives it
        responses["503"] = {"description": "the engine stopped or the server is shutting down",
                            "content": {"application/json": {"schema": {"type": "object"}}}}
    for status in sorted(set(statuses)):
        responses[status] = {"description": WHY[status], "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
