"""The soak test of minigen serve (minigen/measure/serve_soak.py, scripts/serve_soak.py) in small:
two short rounds of 16 streaming clients against make_app over a tiny Llama, a queue short enough
that some are refused with 429, a quarter hanging up; every check of the real run must pass, with
Python's heap standing in for RSS (see the test)."""

from __future__ import annotations

import os

import pytest

import minigen
from conftest import Running, tiny_hf
from minigen.errors import MinigenError
from minigen.loading import DEFAULT_MODEL, load_tokenizer, resolve_folder
from minigen.measure.serve_client import SYSTEM_TEXT
from minigen.measure.serve_soak import format_soak, memory_check, parse_metrics, process_memory, run_soak
from minigen.serving.async_engine import AsyncEngine
from minigen.serving.engine import Engine
from minigen.serving.server import make_app
from minigen.serving.workload import LengthDist, make_workload, system_prompt_ids

METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:request_success counter
vllm:request_success_total{finished_reason="length",model_name="m"} 5.0
vllm:request_success_created{finished_reason="length",model_name="m"} 1.7e9
vllm:request_success_total{finished_reason="stop",model_name="m"} 2.0
"""


def test_the_metrics_the_checks_read():
    m = parse_metrics(METRICS)
    assert (m["running"], m["waiting"], m["kv_usage"], m["finished"]) == (2, 0, 0.25, 7)  # _created is no count


def test_the_memory_check_allows_round_one_warm_up_and_catches_growth():
    mib = 2**20
    assert memory_check([1000 * mib, 1015 * mib, 1019 * mib])["pass"]  # within 2% of 1000 MiB
    assert not memory_check([1000 * mib, 1010 * mib, 1030 * mib])["pass"]
    assert memory_check([100 * mib, 107 * mib])["pass"] and not memory_check([100 * mib, 109 * mib])["pass"]  # 8 MiB
    here = process_memory(os.getpid())
    assert here["rss_bytes"] > 0 and here["hwm_bytes"] >= here["rss_bytes"] and here["python_blocks"] > 0


@pytest.fixture(scope="module")
def served():
    """make_app over a tiny Llama with SmolLM2's vocabulary (4 sequences a step, 8 waiting at most),
    behind uvicorn in a thread on 127.0.0.1 -> (its /v1 URL, the tokenizer)."""
    try:
        tokenizer = load_tokenizer(resolve_folder(DEFAULT_MODEL))
    except MinigenError as e:
        pytest.skip(f"SmolLM2's tokenizer is not available: {e}")
    model = minigen.from_hf(tiny_hf("llama", vocab_size=len(tokenizer), max_position_embeddings=256))
    app = make_app(AsyncEngine(Engine(model, max_batch_size=4, num_blocks=128), max_waiting=8), tokenizer, "tiny",
                   max_context=256)
    running = Running(app)
    yield f"{running.url}/v1", tokenizer
    running.stop()


def test_a_soak_of_two_short_rounds(served):
    url, tokenizer = served
    workload = make_workload(512, float("inf"), seed=2, system_prompt=system_prompt_ids(tokenizer, SYSTEM_TEXT),
                             prompt_tokens=LengthDist(8, 0.5, 2, 32), output_tokens=LengthDist(12, 0.5, 3, 32))
    lines: list[str] = []
    result = run_soak(url, os.getpid(), workload, tokenizer, rounds=2, duration_s=3.0, clients=16,
                      disconnect_fraction=0.25, seed=2, timeout_s=60.0, log=lines.append)
    print(format_soak(result))
    # Every check but RSS: this process's RSS holds the clients too, and its native allocators warm up
    # over ~5 short rounds (measured: 675 -> 724 MiB over 7 rounds of 3 s, then flat) while Python's heap
    # stays flat. In-process, Python's allocated blocks are the leak check: round 2 within 2% of round 1.
    failed = {k: c for k, c in result["checks"].items() if not c["pass"] and k != "memory"}
    assert not failed, format_soak(result)
    blocks = [x["memory"]["python_blocks"] for x in result["rounds"]]
    assert abs(blocks[1] - blocks[0]) <= 0.02 * blocks[0], blocks
    assert len(result["rounds"]) == 2 and len(lines) == 2
    for x in result["rounds"]:
        c = x["counts"]
        # 16 clients, 4 running and 8 waiting at most: the load reached the queue's bound and was refused
        assert c["completed"] > 0 and c["cancelled"] > 0 and c["rate_limited"] > 0, c
        assert c["sent"] == c["completed"] + c["cancelled"] + c["rate_limited"] and c["lost"] == 0
        assert x["metrics_after"]["running"] == 0 and x["metrics_after"]["kv_usage"] == x["metrics_before"]["kv_usage"]
        assert x["output_tokens_per_s"] > 0 and x["ttft_s"]["n"] == c["completed"]
    assert set(result["checks"]) == {f"round {r} {k}" for r in (1, 2) for k in ("outcomes", "server_counted", "idle",
                                                                                  "kv")} | {"memory"}
