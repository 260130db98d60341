"""llama.cpp as an optional engine of `bench` (--engine llama.cpp): the bundled GGUF through
llama-cpp-python, when it is installed. Never a dependency of minigen or its tests.

llama.cpp races in each format of --llama-format, one engine row each ("llama.cpp Q4_0"): the
shipped Q4_1, and Q4_0 and Q8_0 made from it once (gguf_formats.py). Q4_0 is llama.cpp's fastest
CPU format, so racing only the shipped file would not race llama.cpp at its best."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import BenchError
from .gguf_formats import FORMATS, check_format, requantized_gguf


def check_llama_cpp(model_name: str, formats=None) -> tuple[str, ...]:
    """llama.cpp runs the bundled GGUF through llama-cpp-python, when it is installed -> the formats
    to race (default: every one of gguf_formats.FORMATS), each checked, in order, once."""
    formats = tuple(dict.fromkeys(check_format(f) for f in (formats or FORMATS)))
    if importlib.util.find_spec("llama_cpp") is None:
        raise BenchError("--engine llama.cpp needs llama-cpp-python, which is not installed: pip install "
                         "llama-cpp-python (it builds llama.cpp from source; minigen's tests do not need it)")
    if model_name.lower() not in ("smollm2-135m", "smollm2-135m-instruct"):
        raise BenchError(f"--engine llama.cpp runs the bundled GGUF of 'smollm2-135m', not {model_name!r}")
    return formats


def llama_cpp_engines(ids: torch.Tensor, context: int, formats) -> dict[str, tuple[Callable, int]]:
    """-> {"llama.cpp <format>": llama_cpp_engine(...)} for each format, its file made if need be."""
    return {f"llama.cpp {fmt}": llama_cpp_engine(ids, context, requantized_gguf(fmt)) for fmt in formats}


def llama_cpp_engine(ids: torch.Tensor, context: int,
                     path: Path) -> tuple[Callable[[int], tuple[torch.Tensor, int]], int]:
    """-> (run, the GGUF file's bytes). run(n) -> (tokens [1, T + n], 0): llama.cpp's greedy decoding
    of the prompt, on the GGUF file `path`; llama.cpp sizes its own cache, which is not counted here."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=context + 8, n_threads=torch.get_num_threads(),
                n_threads_batch=torch.get_num_threads(), verbose=False)
    prompt = ids[0].tolist()

    def run(n: int):
        llm.reset()
        out = list(prompt)
        for i, token in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            out.append(int(token))
            if i + 1 == n:
                break
        return torch.tensor([out]), 0

    return run, path.stat().st_size
