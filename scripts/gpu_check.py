"""The checks that need CUDA: run them on a GPU machine, get one JSON file naming the hardware.

    python scripts/gpu_check.py [--out gpu_check.json]

Each check is a function `check_<name>() -> dict` registered in CHECKS; add yours there. On a
machine without CUDA the script prints a notice and exits 0 (the CPU tests prove correctness; these
checks only time what needs a GPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import minigen  # noqa: E402
from minigen import GenerationConfig  # noqa: E402
from minigen.generate import decode_step, make_cache, prefill  # noqa: E402


def hardware() -> dict:
    return {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda, "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version()}


def _decode_ms(model, prompt: torch.Tensor, config: GenerationConfig, steps: int) -> tuple[float, torch.Tensor]:
    """Median ms of a decode step (CUDA-synchronized) and the greedy tokens [B, steps]."""
    B, T = prompt.shape
    times, tokens = [], []
    with torch.inference_mode():
        cache = make_cache(model, config, B, T + steps + 1)
        token = prefill(model, prompt, cache).argmax(-1)
        for i in range(steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            token = decode_step(model, token[:, None], torch.tensor([T + i], device=prompt.device), cache).argmax(-1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            tokens.append(token)
    return 1e3 * statistics.median(times[2:]), torch.stack(tokens, dim=1)


# ---------------------------------------------------------------- chapter 3: paged cache and offload
def check_offload(batch: int = 8, prompt_len: int = 1024, steps: int = 32) -> dict:
    """Decode with the KV cache resident, paged, and offloaded to pinned CPU memory with prefetch
    depths 0..4: step time, tokens identical to resident, device bytes and bytes moved per step.
    Depth 0 fetches each layer just in time; deeper prefetch should hide the copies behind compute."""
    model, _ = minigen.load("smollm2-135m")
    model = model.to("cuda")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).cuda()
    base_ms, base_tokens = _decode_ms(model, prompt, GenerationConfig(), steps)
    results = {"batch": batch, "prompt_len": prompt_len, "steps": steps,
               "resident": {"step_ms": base_ms}}
    paged_ms, paged_tokens = _decode_ms(model, prompt, GenerationConfig(cache_chunk_size=16), steps)
    results["paged_16"] = {"step_ms": paged_ms, "speed_vs_resident": base_ms / paged_ms,
                           "tokens_identical": bool(torch.equal(paged_tokens, base_tokens))}
    for depth in (0, 1, 2, 4):
        config = GenerationConfig(prefetch_depth=depth)
        ms, tokens = _decode_ms(model, prompt, config, steps)
        cache = make_cache(model, config, batch, prompt_len + steps + 1)
        results[f"offload_depth_{depth}"] = {
            "step_ms": ms, "slowdown_vs_resident": ms / base_ms,
            "tokens_identical": bool(torch.equal(tokens, base_tokens)),
            "device_kv_bytes": cache.device_nbytes, "host_kv_bytes": cache.nbytes - cache.device_nbytes,
            "bytes_moved_per_step": 2 * model.config.n_layers * cache.layer_nbytes}
    return results


CHECKS = {"offload": check_offload}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="where to write the JSON results")
    parser.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run only these checks")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("Notice: CUDA is not available on this machine, so the GPU checks are skipped "
              "(the CPU test suite proves correctness; run this script on a GPU to time them).")
        return 0
    report = {"hardware": hardware(), "checks": {}}
    for name in args.only or CHECKS:
        print(f"running {name} ...", flush=True)
        report["checks"][name] = CHECKS[name]()
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
