"""Chapter 11 exercise: fix the article's Triton config.

`check_fixed_config(text)`: your config.pbtxt text for serving an LLM through Triton's vLLM backend.
It must parse into Triton's ModelConfig (no unknown field, no bad enum value), be named like its
folder ("llm_model"), and leave none of the article's problems that deploy.review_triton finds:
an engine backend instead of one TorchScript forward per request, no Triton-side batching of whole
generations, text in and out, one engine instance, and decoupled (streamed) responses.
"""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2

from ...production.deploy import parse_model_config, review_triton
from ...errors import DeployError
from . import ExerciseFailed

NAME = "llm_model"  # the article's model folder

SOLUTION = '''name: "llm_model"
backend: "vllm"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "sampling_parameters" data_type: TYPE_STRING dims: [ 1 ] optional: true }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_MODEL } ]
'''


def solution_fixed_config() -> str:
    """The worked solution: the vLLM backend's config, named after the article's folder."""
    return SOLUTION


def check_fixed_config(text) -> bool:
    """Parse `text` as Triton would, then check it serves an LLM the way chapter 11 argues."""
    if not isinstance(text, str) or not text.strip():
        raise ExerciseFailed("check_fixed_config: pass your config.pbtxt as a non-empty string")
    try:
        config = parse_model_config(text, source="your config")
    except DeployError as e:
        raise ExerciseFailed(f"{e}. Hint: protobuf text format is `field: value` and `block {{ ... }}`; "
                             "enum values are bare words such as KIND_MODEL or TYPE_STRING") from None
    if config.name != NAME:
        raise ExerciseFailed(f"name is {config.name!r}: the model's folder is {NAME!r}, and Triton refuses a "
                             "config whose name differs from its folder")
    problems = review_triton(config)
    if problems:
        first = problems[0]
        raise ExerciseFailed(f"{len(problems)} problem(s) left; first, {first.field}: {first.why}")
    if config.backend != "vllm":
        raise ExerciseFailed(f"backend is {config.backend or config.platform!r}: this deployment serves the model "
                             "with Triton's vLLM backend, backend: \"vllm\"")
    kinds = {g.kind for g in config.instance_group}
    if kinds and kinds != {model_config_pb2.ModelInstanceGroup.KIND_MODEL}:
        raise ExerciseFailed("instance_group: with the vLLM backend use kind: KIND_MODEL, so that vLLM places the "
                             "engine on the GPUs itself (a KIND_GPU instance per GPU would load the weights twice)")
    names = {t.name: t for t in config.input}
    if "text_input" not in names or names["text_input"].data_type != model_config_pb2.TYPE_STRING:
        raise ExerciseFailed("input: the vLLM backend takes the prompt as text, an input named text_input of "
                             "TYPE_STRING (it tokenizes on the server), not int32 input_ids")
    print("✓ fixed config: parses as Triton's ModelConfig and none of the article's problems is left")
    return True
