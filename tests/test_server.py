"""`minigen serve`: the OpenAI-compatible server, through the real `openai` client and raw HTTP.

Most tests run a tiny random Llama whose vocabulary is SmolLM2's (so the real tokenizer, its chat
template and its multi-byte tokens apply) behind uvicorn in a thread, on 127.0.0.1 at a free port.
The command line (`python -m minigen serve`, real SmolLM2) runs in a subprocess: real text with
multi-byte characters, and the graceful stop on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.checks import not_a_server_error
from schemathesis import GenerationMode
import schemathesis

import minigen
from conftest import Running, free_port, tiny_hf
from minigen.loading import DEFAULT_MODEL, load_tokenizer, resolve_folder
from minigen.serving.async_engine import AsyncEngine
from minigen.serving.engine import Engine
from minigen.serving.server import make_app

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 256
MODEL = "tiny"
EOS_PROMPT = "The end is near"  # the tiny model's eos is its 3rd greedy token after this prompt


def start(model, tokenizer, *, max_batch_size=4, max_waiting=64, max_context=CONTEXT, api_key=None, step_s=0.0):
    engine = Engine(model, max_batch_size=max_batch_size, num_blocks=64, tokenizer=tokenizer)
    if step_s:  # a slow engine: each step sleeps, so a request stays in flight long enough to act on
        step = engine.step
        engine.step = lambda: (time.sleep(step_s), step())[1]
    async_engine = AsyncEngine(engine, max_waiting=max_waiting)
    app = make_app(async_engine, tokenizer, MODEL, api_key=api_key, max_context=max_context)
    return Running(app, engine, async_engine)


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return load_tokenizer(resolve_folder(DEFAULT_MODEL))
    except minigen.errors.MinigenError as e:
        pytest.skip(f"SmolLM2's tokenizer is not available: {e}")


@pytest.fixture(scope="module")
def model(tokenizer):
    """The tiny Llama with SmolLM2's vocabulary; its eos is the 3rd greedy token after EOS_PROMPT."""
    hf = tiny_hf("llama", vocab_size=len(tokenizer), max_position_embeddings=CONTEXT)
    ids = tokenizer(EOS_PROMPT).input_ids
    out = solo(minigen.from_hf(hf), ids, max_new_tokens=3, stop_token_ids=[])
    assert out[2] not in out[:2], "pick another EOS_PROMPT: its eos would come earlier"
    hf.config.eos_token_id = out[2]
    return minigen.from_hf(hf)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    running = start(model, tokenizer)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def slow(model, tokenizer):
    """One sequence at a time, one waiting at most, 10 ms a step: requests stay in flight."""
    running = start(model, tokenizer, max_batch_size=1, max_waiting=1, step_s=0.01)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def guarded(model, tokenizer):
    """An API key, and a context of 48 so that any request the fuzzer makes is short."""
    running = start(model, tokenizer, api_key="sesame", max_context=48)
    yield running
    running.stop()


def solo(model, ids, tokenizer=None, **overrides) -> list[int]:
    """The new tokens of one request run alone on a fresh Engine."""
    engine = Engine(model, max_batch_size=1, tokenizer=tokenizer)
    rid = engine.add_request(ids, **overrides)
    return engine.run()[rid][len(ids):].tolist()


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=60, **kw)


def text_of(tokenizer, ids: list[int]) -> str:
    """What the Detokenizer's pieces add up to (detokenize.py: no space cleanup)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False).input_ids


# ---------------------------------------------------------------- the openai client
def test_completion_greedy_equals_generate_streamed_or_not(server, model, tokenizer):
    c, prompt = client(server), "Once upon a time"
    ids = tokenizer(prompt).input_ids
    want = minigen.generate(model, torch.tensor([ids]), max_new_tokens=12, stop_token_ids=[]).tokens[0, len(ids):]
    plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert plain.choices[0].text == text_of(tokenizer, want.tolist())
    assert plain.choices[0].finish_reason == "length"
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens, plain.usage.total_tokens) == (
        len(ids), 12, len(ids) + 12)
    chunks = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_sampled_n_choices_stream_equals_plain_and_solo(server, model, tokenizer):
    async def run():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=10,
                  temperature=0.8, top_p=0.9, seed=7, n=2)
        plain = await c.chat.completions.create(**kw)
        texts = ["", ""]
        async for ch in await c.chat.completions.create(stream=True, **kw):
            for choice in ch.choices:
                texts[choice.index] += choice.delta.content or ""
        return plain, texts
    plain, streamed = asyncio.run(run())
    ids = chat_ids(tokenizer, "Tell me a story")
    for i in range(2):
        new = solo(model, ids, max_new_tokens=10, do_sample=True, temperature=0.8, top_p=0.9, seed=7 + i)
        assert plain.choices[i].message.content == text_of(tokenizer, new) == streamed[i]
    assert plain.choices[0].message.content != plain.choices[1].message.content  # seeds 7 and 8 differ
    assert plain.usage.prompt_tokens == len(ids) and plain.usage.completion_tokens == 20


CHOICE_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog", 3]}},
                 "required": ["ok", "kind"], "additionalProperties": False}  # a finite language: every reply ends


def test_response_format_and_penalties_reach_each_choice(server, model, tokenizer):
    """response_format (a JSON schema), the penalties and logit_bias through the openai client: each
    choice's reply parses, follows the schema, and equals its request run alone on the Engine."""
    c = client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": CHOICE_SCHEMA, "strict": True}}
    reply = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick one"}], max_tokens=30,
                                      temperature=0.9, seed=3, n=2, response_format=fmt, frequency_penalty=0.5)
    ids = chat_ids(tokenizer, "Pick one")
    for i, choice in enumerate(reply.choices):
        jsonschema.validate(json.loads(choice.message.content), CHOICE_SCHEMA)
        assert choice.finish_reason == "stop"  # the schema's end: the mask leaves only the stop token
        new = solo(model, ids, max_new_tokens=30, do_sample=True, temperature=0.9, seed=3 + i, frequency_penalty=0.5,
                   response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": CHOICE_SCHEMA}},
                   tokenizer=tokenizer)
        assert choice.message.content == text_of(tokenizer, new[:-1]) and new[-1] in model.config.eos_token_ids
    banned = solo(model, ids, max_new_tokens=1)[0]  # the greedy first token, then banned by a bias
    biased = c.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, presence_penalty=1.5,
                                  logit_bias={str(banned): -100}, extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    new = solo(model, ids, max_new_tokens=4, presence_penalty=1.5, logit_bias={banned: -100}, repetition_penalty=1.3,
               stop_token_ids=[])
    assert biased.choices[0].text == text_of(tokenizer, new) and banned not in new
    regex = c.completions.create(model=MODEL, prompt="Digits:", max_tokens=8, temperature=0,
                                 extra_body={"guided_regex": "[0-9]{3}-[0-9]{2}"}).choices[0].text
    assert re.fullmatch("[0-9]{3}-[0-9]{2}", regex), regex


def test_stop_string_cuts_the_text_and_finishes_stop(server, tokenizer):
    c = client(server)
    whole = c.completions.create(model=MODEL, prompt="Hello there", max_tokens=20, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {whole!r} has no text to stop on"
    for stream in (False, True):
        r = c.completions.create(model=MODEL, prompt="Hello there", max_tokens=20, temperature=0, stop=[stop],
                                 stream=stream, extra_body={"ignore_eos": True})
        chunks = list(r) if stream else [r]
        text = "".join(ch.choices[0].text for ch in chunks)
        assert text == whole[:whole.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_eos_finishes_stop_and_ignore_eos_runs_on(server, tokenizer):
    c = client(server)
    stopped = c.completions.create(model=MODEL, prompt=EOS_PROMPT, max_tokens=10, temperature=0)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 3
    on = c.completions.create(model=MODEL, prompt=EOS_PROMPT, max_tokens=10, temperature=0,
                              extra_body={"ignore_eos": True})
    assert on.choices[0].finish_reason == "length" and on.usage.completion_tokens == 10


def test_logprobs_are_the_models_log_softmax(server, model, tokenizer):
    c, prompt = client(server), "The capital of France"
    ids = tokenizer(prompt).input_ids
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
                             extra_body={"ignore_eos": True})
    new = solo(model, ids, max_new_tokens=4, stop_token_ids=[])
    with torch.no_grad():  # the reference: the whole sequence in one forward, log_softmax of fp32 logits
        hf = tiny_hf("llama", vocab_size=len(tokenizer), max_position_embeddings=CONTEXT)
        logp = hf(torch.tensor([ids + new])).logits[0, len(ids) - 1:-1].float().log_softmax(-1)
    lp = r.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in new]
    for j, t in enumerate(new):
        assert lp.token_logprobs[j] == pytest.approx(logp[j, t].item(), abs=1e-4)
        top = logp[j].topk(3)
        assert sorted(lp.top_logprobs[j].values(), reverse=True) == pytest.approx(top.values.tolist(), abs=1e-4)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=3,
                                     temperature=0, logprobs=True, top_logprobs=2)
    cids = chat_ids(tokenizer, prompt)
    cnew = solo(model, cids, max_new_tokens=3)
    with torch.no_grad():
        clogp = hf(torch.tensor([cids + cnew])).logits[0, len(cids) - 1:-1].float().log_softmax(-1)
    content = chat.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx([clogp[j, t].item() for j, t in enumerate(cnew)], abs=1e-4)
    assert [len(e.top_logprobs) for e in content] == [2] * len(cnew)
    assert content[0].top_logprobs[0].logprob == pytest.approx(clogp[0].max().item(), abs=1e-4)


def test_concurrent_requests_equal_their_solo_runs(server, model, tokenizer):
    prompts = ["One", "Two cats", "Three little pigs went", "Four", "Five and six", "Seven"]

    async def run():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        return await asyncio.gather(*[c.completions.create(
            model=MODEL, prompt=p, max_tokens=8, temperature=0 if i % 2 else 1.0, seed=i,
            extra_body={"ignore_eos": True}) for i, p in enumerate(prompts)])
    results = asyncio.run(run())
    for i, (p, r) in enumerate(zip(prompts, results)):
        kw = dict(do_sample=True, temperature=1.0, seed=i) if i % 2 == 0 else {}
        new = solo(model, tokenizer(p).input_ids, max_new_tokens=8, stop_token_ids=[], **kw)
        assert r.choices[0].text == text_of(tokenizer, new), p


# ---------------------------------------------------------------- errors, raw HTTP
def check_error(r: httpx.Response, status: int, *fragments: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    for f in fragments:
        assert f in err["message"], (f, err["message"])
    if param is not None:
        assert err["param"] == param
    return err


BAD_FIELDS = [  # (route, body changes, param, fragments of the message)
    ("completions", {"temperature": 2.5}, "temperature", ["temperature", "less than or equal to 2"]),
    ("completions", {"top_p": 0}, "top_p", ["top_p", "greater than 0"]),
    ("completions", {"n": 9}, "n", ["'n'", "less than or equal to 8"]),
    ("completions", {"logprobs": 6}, "logprobs", ["logprobs", "less than or equal to 5"]),
    ("completions", {"seed": -1}, "seed", ["seed", "greater than or equal to 0"]),
    ("completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop", ["stop", "at most 4"]),
    ("completions", {"max_tokens": "ten"}, "max_tokens", ["max_tokens", "valid integer", "'ten'"]),
    ("completions", {"max_tokens": True}, "max_tokens", ["max_tokens", "valid integer"]),
    ("completions", {"prompt": 3.5}, "prompt", ["prompt", "a string or a list of token ids"]),
    ("completions", {"prompt": ""}, "prompt", ["the prompt is empty"]),
    ("completions", {"prompt": [10**9]}, "prompt", ["is outside this model's vocabulary"]),
    ("chat", {"messages": []}, "messages", ["messages", "at least 1"]),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages", ["messages.0.role", "'robot'"]),
    ("chat", {"top_logprobs": 3}, "top_logprobs", ["top_logprobs=3 needs logprobs=true"]),
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs", ["less than or equal to 20"]),
    ("chat", {"frequency_penalty": 2.5}, "frequency_penalty", ["frequency_penalty", "less than or equal to 2"]),
    ("completions", {"logit_bias": {"the": 5}}, "logit_bias", ["logit_bias maps token ids", "'the'"]),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     None, ["response_format", "cannot be compiled by llguidance"]),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format", ["response_format.type"]),
    ("completions", {"guided_regex": "(a"}, None, ["guided_regex", "cannot be compiled"]),
]


@pytest.mark.parametrize("route,change,param,fragments", BAD_FIELDS, ids=[f"{r}-{p}" for r, _, p, _ in BAD_FIELDS])
def test_a_bad_field_is_a_400_naming_it(server, route, change, param, fragments):
    body = {"model": MODEL, "max_tokens": 2}
    body.update({"prompt": "hi"} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(f"{server.url}/v1/{'chat/' if route == 'chat' else ''}completions", json={**body, **change})
    check_error(r, 400, *fragments, param=param)


def test_errors_are_openai_error_objects(server):
    url = server.url + "/v1/completions"
    r = httpx.post(url, json={"model": MODEL, "prompt": list(range(5, 255)), "max_tokens": 10})
    check_error(r, 400, "250 prompt tokens + max_tokens=10 = 260", "context is 256", param="max_tokens")
    check_error(httpx.post(url, json={"model": "gpt-4", "prompt": "hi"}), 404, "'gpt-4' does not exist", "'tiny'",
                param="model")
    check_error(httpx.post(url, content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"}),
                400, "not valid JSON")
    check_error(httpx.post(url, content=b"[1, 2]", headers={"content-type": "application/json"}), 400, "invalid")
    check_error(httpx.get(server.url + "/v2/nothing"), 404, "no route GET /v2/nothing", "/v1/completions")
    check_error(httpx.get(url), 405, "no route GET /v1/completions")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [MODEL]
    # a field the server would have to ignore is refused, named; its no-op value (or null) and `user` are taken
    check_error(httpx.post(url, json={"model": MODEL, "prompt": "hi", "echo": True}), 400,
                "'echo' is one of OpenAI's fields that minigen serve does not implement", param="echo")
    check_error(httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_token": 2}), 400,
                "'max_token' is not a field of this route", param="max_token")
    check_error(httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
        400, "'tools' is one of OpenAI's fields", param="tools")
    r = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "echo": False, "tools": [],
                              "suffix": None, "user": "u"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_api_key_guards_every_route_but_health(guarded):
    url = guarded.url
    assert httpx.get(url + "/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/openapi.json"):
        check_error(httpx.get(url + path), 401, "Authorization: Bearer KEY")
        check_error(httpx.get(url + path, headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        client(guarded, api_key="wrong").models.list()
    r = client(guarded, api_key="sesame").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_a_draining_server_answers_503(guarded):
    """Between SIGTERM and the listener's close, new requests get 503 (retry elsewhere), and so
    does /health, so a load balancer stops routing here."""
    served, auth = guarded.app.state.served, {"Authorization": "Bearer sesame"}
    served.draining = True
    try:
        r = httpx.post(guarded.url + "/v1/completions", headers=auth, json={"model": MODEL, "prompt": "hi"})
        check_error(r, 503, "shutting down")
        assert r.headers["retry-after"] == "1"
        check_error(httpx.get(guarded.url + "/health"), 503, "shutting down")
    finally:
        served.draining = False
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_a_failed_step_is_a_generic_500_never_a_traceback(model, tokenizer):
    broken = start(model, tokenizer)
    steps, step = [], broken.engine.step

    def fails_third():  # a prefill and a decode, then the step raises
        steps.append(1)
        if len(steps) >= 3:
            raise RuntimeError("secret internals of the step")
        return step()
    broken.engine.step = fails_third
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "ignore_eos": True}
    try:
        with httpx.stream("POST", broken.url + "/v1/completions", json={**body, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"  # the status line had gone: the error is an event
        assert "the server failed while generating this response" in lines[-2]
        assert "secret internals" not in "".join(lines) and "Traceback" not in "".join(lines)
        r = httpx.post(broken.url + "/v1/completions", json=body)  # the engine thread has stopped
        check_error(r, 500, "the server failed on this request; it has been logged")
        assert "secret internals" not in r.text
    finally:
        broken.stop()


def stream_in_thread(url: str, body: dict, seen: list, started: threading.Event):
    """Stream a completion in a thread, appending each event; `started` once the first one came."""
    def run():
        try:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        seen.append(line)
                        started.set()
        except Exception as e:  # a cut stream (httpx.RemoteProtocolError) or a refusal, for the test to see
            seen.append(e)
        started.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_full_queue_is_429_with_retry_after(slow):
    long = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True}
    seen, started = [], threading.Event()
    running = stream_in_thread(slow.url, long, seen, started)
    assert started.wait(30)
    waiting = stream_in_thread(slow.url, long, [], threading.Event())  # one waits: max_waiting=1
    deadline = time.monotonic() + 10
    while slow.async_engine.snapshot()["waiting"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r = httpx.post(slow.url + "/v1/completions", json={**long, "max_tokens": 2})
    check_error(r, 429, "max_waiting=1")
    assert r.headers["retry-after"] == "1"
    running.join(30)  # the two streams run to their end (2 s each at 10 ms a step)
    waiting.join(30)
    assert seen[-1] == "data: [DONE]"


def test_a_client_that_leaves_mid_stream_frees_its_blocks(slow):
    deadline = time.monotonic() + 30
    while slow.async_engine.snapshot()["running"] or slow.async_engine.snapshot()["waiting"]:
        assert time.monotonic() < deadline, "the slow server stayed busy"
        time.sleep(0.05)
    free = slow.async_engine.snapshot()["free_blocks"]
    body = {"model": MODEL, "prompt": "a b c d e f g h i j k l m n o p q r s t u v w x y z", "max_tokens": 200,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", slow.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert slow.async_engine.snapshot()["free_blocks"] < free  # it holds blocks now
    left = time.monotonic()  # 200 tokens at 10 ms a step: ~2 s more, had it not been cancelled
    while slow.async_engine.snapshot()["free_blocks"] != free:
        assert time.monotonic() - left < 1.0, "the request kept its blocks after its client left"
        time.sleep(0.01)
    assert slow.async_engine.snapshot()["running"] == 0


# ---------------------------------------------------------------- metrics
def scrape(url: str, **kw) -> dict:
    """{(name, labels as a sorted tuple): value} of every sample."""
    text = httpx.get(url + "/metrics", **kw).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_have_vllms_names_and_move(server):
    before = scrape(server.url)
    names = {name for name, _ in before}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total"):
        assert name in names, name
    label = (("model_name", MODEL),)
    r = client(server).completions.create(model=MODEL, prompt="Count to five", max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    after = scrape(server.url)

    def moved(name, labels=label):
        return after[(name, labels)] - before.get((name, labels), 0.0)
    assert moved("vllm:generation_tokens_total") == r.usage.completion_tokens == 5
    assert moved("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:request_success_total", (("finished_reason", "length"), ("model_name", MODEL))) == 1
    assert 0 <= after[("vllm:kv_cache_usage_perc", label)] <= 1


# ---------------------------------------------------------------- the OpenAPI schema, fuzzed
def test_schemathesis_finds_no_server_error(guarded):
    auth = {"Authorization": "Bearer sesame"}
    schema = schemathesis.openapi.from_url(guarded.url + "/openapi.json", headers=auth)
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    for op in operations:
        # a route without a body or parameters has no invalid request to make: only valid ones
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])
        for mode in modes:
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=15, deadline=None, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck), database=None)
            def fuzz(case):
                case.call_and_validate(base_url=guarded.url, headers=auth, checks=[not_a_server_error], timeout=30)
            fuzz()


# ---------------------------------------------------------------- the command line, real SmolLM2
class CliServer:
    """`python -m minigen serve` in a subprocess on the real SmolLM2, started on demand."""

    def __init__(self):
        self.proc = None

    def ensure(self) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self.port = free_port()
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
            self.proc = subprocess.Popen([sys.executable, "-m", "minigen", "serve", "--port", str(self.port),
                                          "--grace-s", "3", "--max-batch-size", "2", "--num-blocks", "64"],
                                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 90
            while True:
                assert self.proc.poll() is None, self.proc.stdout.read().decode()
                assert time.monotonic() < deadline, "minigen serve did not start in 90 s"
                try:
                    if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def cli(tokenizer):
    server = CliServer()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(10)


def test_multibyte_text_comes_whole_in_streams(cli):
    c = openai.OpenAI(base_url=cli.ensure() + "/v1", api_key="none", max_retries=0, timeout=60)
    prompt = "你好世界 🙂 你好世界 🙂 你好世界 🙂 你好世界 🙂 你好世界"
    kw = dict(model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, temperature=0)
    plain = c.completions.create(**kw).choices[0].text
    pieces = [ch.choices[0].text for ch in c.completions.create(stream=True, **kw)]
    assert "".join(pieces) == plain
    assert any(ord(ch) > 0x2FFF for ch in plain), f"no multi-byte character in {plain!r}: pick another prompt"
    assert not any("\ufffd" in p for p in pieces), pieces


def test_sigterm_lets_the_request_finish_within_grace_and_exits_0(cli):
    url = cli.ensure()
    seen, started = [], threading.Event()
    reader = stream_in_thread(url, {"model": DEFAULT_MODEL, "prompt": "Once upon a time", "max_tokens": 900,
                                    "temperature": 0, "ignore_eos": True}, seen, started)
    assert started.wait(60) and isinstance(seen[0], str), seen
    cli.proc.send_signal(signal.SIGTERM)
    sent, at_signal = time.monotonic(), len(seen)
    assert cli.proc.wait(30) == 0, cli.proc.stdout.read().decode()
    reader.join(10)
    assert not reader.is_alive()
    assert time.monotonic() - sent < 3 + 10  # grace 3 s, and the engine's stop
    assert len(seen) > at_signal + 1, "the request was cut at once, not let run within the grace"
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)
