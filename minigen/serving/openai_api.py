"""OpenAI's API, as data: the request bodies of /v1/completions and /v1/chat/completions, what
they become for the engine, the responses and stream chunks built from the tokens, and OpenAI's
error object. server.py routes HTTP to these; nothing here touches the network.

The request models are strict (a bool is no number, "5" no integer) and check every range when a
body is parsed, so a bad field is refused with its name and its range before any work starts.
A field the server does not implement is refused too (`unsupported`), as OpenAI refuses an
unrecognized argument, rather than silently ignored: a client that asks for tools or echo=true
would otherwise get a reply made without them. The no-op value of such a field (null, tools=[],
echo=false, ...) is accepted, since some clients send those defaults. The penalties, logit_bias,
response_format (a token mask: decoding/) and vLLM's top_k, min_p, repetition_penalty, guided_regex
and guided_grammar are applied per choice by the Engine. `user` is accepted and ignored: it only labels the request for the caller's logs.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field

SEED_MAX = 2**63 - 1  # OpenAI's seed is a signed 64-bit integer
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens of /v1/completions
FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}  # engine -> OpenAI ("abort": vLLM's word)


# ---------------------------------------------------------------- requests
StopString = Annotated[str, Field(min_length=1)]  # "" would match everywhere


# OpenAI fields minigen serve does not implement, with the value that asks for nothing
NO_OP_VALUES = {"echo": False, "best_of": 1, "suffix": "", "tools": [], "tool_choice": "none",
                "parallel_tool_calls": True, "store": False, "service_tier": "auto", "modalities": ["text"],
                "metadata": {}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False  # a last chunk with `choices: []` and the usage of the whole request


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = "reply"  # OpenAI asks for one; minigen only reports it
    schema_: dict = Field(alias="schema")  # the JSON schema the reply must follow
    strict: bool | None = None  # OpenAI's switch; the mask is always exact, so accepted either way
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: {"type": "json_schema", "json_schema": {...}}, "json_object" or "text"."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(BaseModel):
    """The fields both routes share; any other top-level field is kept in model_extra for `unsupported`."""
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)  # new tokens; None: 16 (completions), the context left (chat)
    temperature: float = Field(1.0, ge=0, le=2)  # 0: greedy (argmax)
    top_p: float = Field(1.0, gt=0, le=1)  # nucleus sampling; 1: every token
    seed: int | None = Field(None, ge=0, le=SEED_MAX)  # choice i samples with seed + i; None: fresh entropy
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None  # cut, with what follows
    n: int = Field(1, ge=1, le=8)  # choices, each its own engine request
    stream: bool = False  # server-sent events, `data: [DONE]` last
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: do not stop on the end-of-sequence token
    frequency_penalty: float = Field(0.0, ge=-2, le=2)  # minus count x this, per token of the reply so far
    presence_penalty: float = Field(0.0, ge=-2, le=2)  # minus this once a token has appeared in the reply
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None  # the reply must be JSON (of a schema): a token mask
    # vLLM's extensions, with vLLM's names
    top_k: int | None = Field(None, ge=-1)  # -1 or None: every token
    min_p: float = Field(0.0, ge=0, le=1)  # drop tokens below min_p x the top token's probability
    repetition_penalty: float = Field(1.0, gt=0, le=100)  # transformers' rule, over the prompt and the reply
    guided_regex: str | None = None  # the reply must match this regular expression
    guided_grammar: str | None = None  # the reply must match this Lark grammar
    user: str | None = None  # accepted and ignored

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]  # text, or token ids (one prompt per request)
    logprobs: int | None = Field(None, ge=0, le=5)  # the sampled token's logprob and the top k


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name of max_tokens; wins over it
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)  # needs logprobs=true


class ApiError(Exception):
    """A request the server refuses: its HTTP status, message, and the field (`param`) at fault."""
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


# ---------------------------------------------------------------- requests -> prompts and engine overrides
def unsupported(req: SamplingRequest) -> None:
    """ApiError (400) naming the first field of the body that minigen serve would have to ignore: one
    it does not know, or one of OpenAI's it does not implement set to anything but its no-op value."""
    for name, value in (req.model_extra or {}).items():
        if value is None or (name in NO_OP_VALUES and value == NO_OP_VALUES[name]):
            continue
        what = "is one of OpenAI's fields that minigen serve does not implement" if name in NO_OP_VALUES else \
            "is not a field of this route"
        raise ApiError(400, f"'{name}' {what}, so it would be ignored: drop it (the fields each route takes are "
                       "in GET /openapi.json)", name)


def completion_prompt(tokenizer, prompt: str | list[int]) -> list[int]:
    ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise ApiError(400, "the prompt is empty: give some text or at least one token id", "prompt")
    return ids


def chat_prompt(tokenizer, req: ChatRequest) -> list[int]:
    """The messages through the tokenizer's chat template, with the assistant's turn opened."""
    if tokenizer.chat_template is None:
        raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as e:  # a template that refuses an order of roles raises its own message
        raise ApiError(400, f"the model's chat template refused these messages: {e}", "messages") from None
    return tokenizer(text, add_special_tokens=False).input_ids


def new_tokens(req: SamplingRequest, prompt_len: int, max_context: int) -> int:
    """The request's max_new_tokens, checked against the context: ApiError naming both lengths."""
    name = "max_tokens"
    asked = req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        name, asked = "max_completion_tokens", req.max_completion_tokens
    if asked is None:
        asked = COMPLETION_MAX_TOKENS if isinstance(req, CompletionRequest) else max_context - prompt_len
    if prompt_len + asked > max_context or asked < 1:
        field = name if prompt_len < max_context else "messages" if isinstance(req, ChatRequest) else "prompt"
        raise ApiError(400, f"this request has {prompt_len} prompt tokens + {name}={asked} = {prompt_len + asked} "
                       f"tokens, and the model's context is {max_context} tokens: shorten the prompt or lower "
                       f"{name} to at most {max(max_context - prompt_len, 0)}", field)
    return asked


def logprobs_k(req: SamplingRequest) -> int | None:
    """How many top logprobs the engine records per token (None: none, no cost)."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, f"top_logprobs={req.top_logprobs} needs logprobs=true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def engine_overrides(req: SamplingRequest, max_new_tokens: int) -> list[dict]:
    """One dict of Engine request keys per choice: choice i samples with seed + i (greedy: all alike)."""
    base: dict = {"max_new_tokens": max_new_tokens, **processing_overrides(req)}
    if req.ignore_eos:
        base["stop_token_ids"] = []  # no stop token at all: max_new_tokens ends it
    if req.temperature == 0:  # greedy draws nothing: seed, top_p, top_k and min_p change nothing, and the config refuses them
        return [{**base, "do_sample": False} for _ in range(req.n)]
    base.update(do_sample=True, temperature=req.temperature, top_p=req.top_p if req.top_p < 1 else None,
                top_k=req.top_k if req.top_k not in (None, -1, 0) else None, min_p=req.min_p or None)
    return [{**base, "seed": None if req.seed is None else req.seed + i} for i in range(req.n)]


def processing_overrides(req: SamplingRequest) -> dict:
    """The Engine keys of the fields that process a choice's logits (penalties, bias, structure), at
    their defaults left out; the Engine checks their values and compiles the structure (400 if it cannot)."""
    out: dict = {}
    for key, off in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(req, key) != off:
            out[key] = getattr(req, key)
    if req.logit_bias:
        if not all(k.isascii() and k.isdigit() for k in req.logit_bias):
            raise ApiError(400, "logit_bias maps token ids, written as decimal strings (\"50256\"), to biases in "
                           f"[-100, 100]; got the key {next(k for k in req.logit_bias if not k.isdigit())!r}",
                           "logit_bias")
        out["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(400, "response_format of type json_schema needs json_schema: {\"name\": ..., "
                           "\"schema\": {...}}", "response_format")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.json_schema.name,
                                                                          "schema": fmt.json_schema.schema_}}
    elif fmt is not None and fmt.type == "json_object":
        out["response_format"] = {"type": "json_object"}
    for key in ("guided_regex", "guided_grammar"):
        if getattr(req, key) is not None:
            out[key] = getattr(req, key)
    return out


# ---------------------------------------------------------------- responses
@dataclass
class Choice:
    """What one choice has produced so far: its text, tokens and logprobs, and why it ended."""
    index: int
    text: str = ""
    tokens: int = 0
    logprobs: list = field(default_factory=list)  # one (token_id, logprob, [(id, logprob)] top) per token
    finish_reason: str | None = None


def request_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, entries: list, offset: int) -> dict:
    """/v1/completions' logprobs object: tokens, token_logprobs, top_logprobs and text_offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, logprob, top in entries:
        text = token_text(tokenizer, token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append({token_text(tokenizer, i): lp for i, lp in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokenizer, entries: list) -> dict:
    """/v1/chat/completions' logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**item(t, lp), "top_logprobs": [item(i, x) for i, x in top]} for t, lp, top in entries]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, rid: str, model: str, created: int, choices: list, chunk: bool = False) -> dict:
    obj = {"completion": "text_completion", "chat": "chat.completion.chunk" if chunk else "chat.completion"}[kind]
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}


def choice_body(kind: str, tokenizer, c: Choice, wants_logprobs: bool, *, chunk: bool = False,
                first: bool = False, offset: int = 0) -> dict:
    """A choice of a response (chunk=False: the whole text) or of a stream chunk (its new text)."""
    if kind == "completion":
        lp = completion_logprobs(tokenizer, c.logprobs, offset) if wants_logprobs else None
        return {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
    lp = chat_logprobs(tokenizer, c.logprobs) if wants_logprobs else None
    if not chunk:
        message = {"role": "assistant", "content": c.text}
        return {"index": c.index, "message": message, "logprobs": lp, "finish_reason": c.finish_reason}
    delta = {"role": "assistant", "content": c.text} if first else {"content": c.text}
    return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason}


def now_s() -> int:
    return int(time.time())


# ---------------------------------------------------------------- errors
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """FastAPI's validation errors (pydantic's) -> (one message naming the field and its range, param)."""
    def field_path(e: dict) -> list[str]:
        return [str(x) for x in e.get("loc", ()) if x != "body"]
    first = errors[0]
    loc = field_path(first)
    # a union field (stop, prompt) fails once per member: a range error says more than a type mismatch
    same = [e for e in errors if field_path(e)[:1] == loc[:1]]
    first = next((e for e in same if not e.get("type", "").endswith("_type")), first)
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON ({detail}): send a JSON object", None
    loc = field_path(first)
    if not loc:
        return f"the request body is invalid: {first.get('msg', '')}; send a JSON object of the API's fields", None
    # a union's member names ('str', 'list[int]') sit in the location: keep the field's own path
    path = [p for p in loc if (p.isidentifier() or p.isdigit()) and p not in ("str", "int", "float", "bool")]
    name = ".".join(path) or loc[0]
    got = repr(first["input"]) if "input" in first and first.get("type") != "missing" else None
    if got is not None and len(got) > 60:
        got = got[:57] + "..."
    msg = first.get("msg", "invalid")
    extra = {"stop": " (a string or a list of at most 4 strings)",
             "prompt": " (a string or a list of token ids)"}.get(loc[0], "")
    return f"invalid '{name}': {msg}{extra}" + (f", got {got}" if got is not None else ""), loc[0]
