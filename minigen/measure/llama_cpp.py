"""llama.cpp as an optional engine of `bench` (--engine llama.cpp): the bundled Q4_1 GGUF through
llama-cpp-python, when it is installed. Never a dependency of minigen or its tests."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from ..errors import BenchError


def check_llama_cpp(model_name: str) -> None:
    """llama.cpp runs the bundled GGUF through llama-cpp-python, when it is installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise BenchError("--engine llama.cpp needs llama-cpp-python, which is not installed: pip install "
                         "llama-cpp-python (it builds llama.cpp from source; minigen's tests do not need it)")
    if model_name.lower() not in ("smollm2-135m", "smollm2-135m-instruct"):
        raise BenchError(f"--engine llama.cpp runs the bundled GGUF of 'smollm2-135m', not {model_name!r}")


def llama_cpp_engine(ids: torch.Tensor, context: int) -> tuple[Callable[[int], tuple[torch.Tensor, int]], int]:
    """-> (run, the GGUF file's bytes). run(n) -> (tokens [1, T + n], 0): llama.cpp's greedy decoding
    of the prompt, on the Q4_1 GGUF file; llama.cpp sizes its own cache, which is not counted here."""
    from llama_cpp import Llama
    from ..loading import default_gguf_path
    path = default_gguf_path()
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
