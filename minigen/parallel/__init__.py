"""Parallelism over torch.distributed: tensor parallelism (tensor.py), pipeline parallelism (pipeline.py)
and the local process group that runs them (group.py). gloo on a CPU, NCCL on a GPU: the same code.

    def work(rank, tp_size):                       # runs in each rank, inside the group
        model, tok = minigen.load("smollm2-135m", tp_size=tp_size)
        return minigen.generate(model, ids, max_new_tokens=32).tokens
    tokens = minigen.parallel.run_ranks(work, 3)   # [rank 0's, rank 1's, rank 2's]: all equal

Pipeline parallelism splits the layers instead (pipeline.py); its ranks' work is a function of this
package, so a notebook can start them too:

    answers = run_ranks(pipeline_worker, 2, args=("smollm2-135m", ids, 4))   # 2 stages, 4 micro-batches
    bubble([a["times"] for a in answers], rows=ids.shape[0])["busy"]          # each stage's busy fraction

docs/design/tensor_parallel.md says what each rank holds and what a sharded model refuses.
"""

from .group import run_ranks
from .pipeline import (PipelineOutput, Stage, StageTimes, bubble, check_stages, make_stage, pipeline_generate,
                       pipeline_worker, stage_layers, stage_of)
from .tensor import check_tp_size, local_config, shard_model, shard_of, working_sizes

__all__ = ["PipelineOutput", "Stage", "StageTimes", "bubble", "check_stages", "check_tp_size", "local_config",
           "make_stage", "pipeline_generate", "pipeline_worker", "run_ranks", "shard_model", "shard_of",
           "stage_layers", "stage_of", "working_sizes"]
