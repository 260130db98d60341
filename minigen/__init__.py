"""minigen: how a large language model generates text fast, one readable step at a time."""

from .caches.contract import Cache
from .caches.make import make_cache
from .config import GenerationConfig
from .serving.engine import Engine
from .errors import (BenchError, CacheFullError, ConfigError, LedgerError, MinigenError, ModelLoadError, PositionError,
                     PromptError, QueueFullError, RequestError)
from .generate import GenerationOutput, generate, parallel_sample, stream
from .stats import GenerationStats
from .run_plan import Plan, make_plan
from .loading import from_hf, load
from .evaluate import perplexity, score, top1_agreement
from .model import Model
from .checkpoints.model_config import ModelConfig
from .measure.plan import plan
from .numerics.weight_quant import quantize_weights
from .sampling import sample
from .steps.eager import decode_step, prefill

__all__ = ["Cache", "Engine", "GenerationConfig", "GenerationOutput", "GenerationStats", "Model", "ModelConfig", "Plan",
           "BenchError", "CacheFullError", "ConfigError", "LedgerError", "MinigenError", "ModelLoadError",
           "PositionError", "PromptError", "QueueFullError", "RequestError",
           "decode_step", "from_hf", "generate", "load", "make_cache", "make_plan", "parallel_sample", "perplexity",
           "plan", "prefill", "quantize_weights", "sample", "score", "stream", "top1_agreement"]
__version__ = "0.1.0"
