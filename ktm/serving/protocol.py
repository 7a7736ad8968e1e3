"""The OpenAI request shapes `ktm serve` accepts, its one extension field, OpenAI's error shape.

Unknown fields are refused (``extra="forbid"``), so a client that relies on an option this server
does not implement (``echo``, penalties, tools) gets a 400 naming it instead of a silently
different answer; such an option sent with its neutral value (``presence_penalty: 0``,
``echo: false``, ...) is accepted, and ``null`` means a field's default, as in OpenAI's API.
Logprobs of the generated tokens are implemented (``logprobs`` of a completion, ``logprobs`` and
``top_logprobs`` of a chat), with OpenAI's limits.

The ktm extension is one optional field named ``ktm``; with the official client it goes in
``extra_body``. It says which parts are merged and which stay plain:

    completions:  "ktm": {"segments": [{"text": "<long document>", "merge": true},
                                       {"text": "\\nQuestion: ...? Answer:", "merge": false}]}
                  ("prompt" is then omitted, null, "" or exactly the segments' texts joined)
    chat:         a message may carry "ktm": {"merge": false} (the whole content plain) or
                  "ktm": {"segments": [...]} (its content as segments; "content" as above)
    both:         "ktm": {"merge": false} at the top level feeds everything plain (the
                  uncompressed baseline); "ktm": {"ignore_eos": true} always generates max_tokens

Without it, every chat message's content is merged but for the end of the newest user message, its
question, read plain (``ktm.core.question.split_question``); a text completion prompt is read by the
same rule, or, with "ktm": {"question": TEXT}, merged whole with TEXT after it as its question ("":
no question, the prompt merged whole). The chat template's own text (role markers, the generation
prompt) is always plain.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# options this server does not implement, with the values that leave an answer unchanged: some
# clients always send them, so these values are accepted; any other value is refused (400)
NEUTRAL = {"presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
           "echo": (False,), "best_of": (1,), "response_format": ({"type": "text"},)}
# why an option is not implemented, when it is not just work left to do
WHY = {"echo": "the prompt is merged before the model reads it (K tokens to one embedding), so "
               "its tokens have no logprobs of their own to echo"}


MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_N = 128  # OpenAI's limit on choices
MAX_MESSAGES = 2048  # messages in a chat (a 64-turn chat has 129)
MAX_SEGMENTS = 1024  # ktm.segments of a prompt or of a message


def _is(value, neutral) -> bool:
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_omitted(cls, data):
        """OpenAI's optional fields are nullable: ``null`` means the field's default."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class SegmentIn(Strict):
    text: str
    merge: bool = Field(True, strict=True)
    # a merged segment read at this ratio (tokens per position, adaptive merging); None: the
    # request's ratio, else the model's (at most the reader's largest level: checked against
    # the loaded model, ``ktm.serving.prompts.check_ratios``)
    ratio: float | None = Field(None, ge=1, allow_inf_nan=False, strict=True)


class KtmOptions(Strict):
    merge: bool = Field(True, strict=True)  # False: every part plain
    # completions only; as many as MAX_SEGMENTS (counted before any is read)
    segments: list[SegmentIn] | None = Field(None, min_length=1, max_length=MAX_SEGMENTS)
    ignore_eos: bool = Field(False, strict=True)
    # every merged part read at this ratio (Segment(ratio=...)); None: the model's layout
    ratio: float | None = Field(None, ge=1, allow_inf_nan=False, strict=True)
    # a KV press on the compressed segments (ktm.decode.press names; "none": none); None: the
    # server's --press. press_ratio: its share of the KV dropped (None: the server's)
    press: str | None = None
    press_ratio: float | None = Field(None, ge=0, lt=1, allow_inf_nan=False, strict=True)
    # completions only: what the prompt asks, read plain after it as its question
    # (ktm.core.question; "": none, the prompt merged whole); None: the prompt's own end, as a
    # chat's newest user message is read (ktm.core.question.split_question)
    question: str | None = Field(None, strict=True)
    # a chat read within this many positions, its oldest unmarked messages merged to fit
    # (ktm.serving.history); None: the server's --history-budget, 0: none
    history_budget: int | None = Field(None, ge=0, strict=True)
    # over the budget, the history read plain and its KV pressed to fit by this press instead
    # of merged (ktm.serving.prompts.chat_reading); None: the server's --history-press, "none"
    history_press: str | None = None


class MessageKtm(Strict):
    merge: bool | None = Field(None, strict=True)
    segments: list[SegmentIn] | None = Field(None, min_length=1, max_length=MAX_SEGMENTS)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    ktm: MessageKtm | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(Strict):
    include_usage: bool = Field(False, strict=True)


class Sampling(Strict):
    model: str
    # integers are strict: pydantic's lax mode reads true as 1 and "7" as 7
    max_tokens: int | None = Field(None, ge=1, strict=True)
    # numbers and booleans are strict too: "0.5" and "yes" are refused, as OpenAI's API does
    temperature: float = Field(1.0, ge=0.0, le=2.0, strict=True)  # 0: greedy
    top_p: float = Field(1.0, ge=0.0, le=1.0, strict=True)  # 0: greedy, as OpenAI takes it
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1, strict=True)  # int64, as OpenAI's
    n: int = Field(1, ge=1, le=MAX_N, strict=True)  # choices, as OpenAI's
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    user: str | None = None
    ktm: KtmOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if not (k in NEUTRAL and any(_is(v, n) for n in NEUTRAL[k]))}
        return data

    def check_stream_options(self) -> None:
        """As OpenAI: ``stream_options`` without ``stream: true`` is a 400, not ignored."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("The 'stream_options' parameter is only allowed when 'stream' is "
                               "enabled.", param="stream_options")

    def logprobs_asked(self) -> int | None:
        """The alternatives to report per generated token (0: the sampled token's logprob only),
        or None: no logprobs asked."""
        raise NotImplementedError

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise RequestError(f"Invalid 'stop': {len(stops)} stop sequences, expected at most "
                               f"{MAX_STOP}", param="stop", code="array_above_max_length")
        return [s for s in stops if s]


class CompletionRequest(Sampling):
    # checked by prompt_values, whose errors name the element: pydantic's lax mode would turn
    # true or "7" into a token id, and its union errors name no element
    prompt: str | list[Any] | None = None
    # OpenAI's legacy completions: the sampled token's logprob and the N most likely, N <= 5
    logprobs: int | None = Field(None, ge=0, le=5, strict=True)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_none(cls, value):
        return None if value is False else value  # some clients send false for "none"

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_values(self) -> list[str | tuple[int, ...]]:
        """The prompts, as OpenAI takes them: a text, token ids (a list of integers), or a list
        of texts or of token-id lists (a choice or ``n`` for each)."""
        p = self.prompt
        if not isinstance(p, list) or not p:
            return [p or ""]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) for x in p):
            return [_token_ids(x, f"prompt[{i}]") for i, x in enumerate(p)]
        return [_token_ids(p, "prompt")]


def _token_ids(values: list, where: str) -> tuple[int, ...]:
    for i, v in enumerate(values):
        if not isinstance(v, int) or isinstance(v, bool):
            raise RequestError(f"{where}[{i}] is {shown(v)}: expected a token id (an "
                               "integer); a prompt is a string, a list of strings, a list of "
                               "token ids or a list of token-id lists", param="prompt")
    return tuple(values)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=20, strict=True)  # OpenAI's 0..20

    def logprobs_asked(self) -> int | None:
        """As OpenAI: ``top_logprobs`` asks for alternatives only with ``logprobs: true`` (0,
        which asks for none, is accepted alone, as vLLM does)."""
        n = self.top_logprobs
        if n and not self.logprobs:
            raise RequestError(f"top_logprobs={n} needs logprobs=true: 'logprobs' must be set to "
                               "true if 'top_logprobs' is used", param="top_logprobs")
        return (n or 0) if self.logprobs else None


class RequestError(Exception):
    """A bad request: answered with ``status`` and OpenAI's error object, the server goes on."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message, param, code, status, kind)
        self.headers = headers  # of the answer (a 503's Retry-After)

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# the names pydantic gives a union's members in an error's location ("str", "list[TextPart]")
UNION_MEMBER = re.compile(r"^(str|int|float|bool|(list|dict|tuple)\[.*|[A-Z]\w*)$")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic errors of a request body -> (one readable message, the offending field).

    A value that fits none of a union's members gets an error for each; the deepest one names
    the part that is wrong (a content part of type "image_url", not "should be a valid string").
    """
    e = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = [str(x) for x in e.get("loc", ())
           if x != "body" and not (isinstance(x, str) and UNION_MEMBER.match(x))]
    where = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    if e.get("type") == "extra_forbidden" and where in NEUTRAL:
        ok = " or ".join(json.dumps(n) for n in NEUTRAL[where])
        why = f": {WHY[where]}" if where in WHY else ""
        return (f"{where}={shown(e.get('input'))} is not supported by this server{why}; it "
                f"accepts only {ok} or null (or the field left out)", where)
    if e.get("type") == "extra_forbidden":
        return f"unknown field {where!r}: this server does not accept it", where
    if e.get("type") == "missing" and where is None:
        return ("the request body is empty: expected a JSON object with the request's fields",
                None)
    if e.get("type") == "missing":
        return f"missing required field {where!r}", where
    msg = str(e.get("msg"))
    if isinstance(e.get("input"), (str, int, float, bool)):
        msg += f", got {shown(e['input'])}"
    return (f"{where}: {msg}" if where else msg), where


def shown(value: Any, limit: int = 80) -> str:
    """A value a client sent, as an error message quotes it: JSON, cut to ``limit`` characters,
    a long list or object by its size (an error never echoes megabytes back)."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"<{'an object' if isinstance(value, dict) else 'a list'} of {len(value)} entries>"
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
