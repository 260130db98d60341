"""minigen: how a large language model generates text fast, one readable step at a time."""

from .caches.contract import Cache
from .caches.make import make_cache
from .config import GenerationConfig
from .serving.engine import Engine
from .errors import (BenchError, CacheFullError, ConfigError, LedgerError, MinigenError, ModelLoadError, PositionError,
                     PromptError, QueueFullError, RequestError)
from .generate import GenerationOutput, GenerationStats, generate, parallel_sample, stream
from .loading import from_hf, load
from .evaluate import perplexity, score, top1_agreement
from .model import Model
from .checkpoints.model_config import ModelConfig
from .measure.plan import plan
from .numerics.weight_quant import quantize_weights
from .sampling import sample
from .steps.eager import decode_step, prefill

__all__ = ["Cache", "Engine", "GenerationConfig", "GenerationOutput", "GenerationStats", "Model", "ModelConfig",
           "BenchError", "CacheFullError", "ConfigError", "LedgerError", "MinigenError", "ModelLoadError",
           "PositionError", "PromptError", "QueueFullError", "RequestError",
           "decode_step", "from_hf", "generate", "load", "make_cache", "parallel_sample", "perplexity",
           "plan", "prefill", "quantize_weights", "sample", "score", "stream", "top1_agreement"]
__version__ = "0.1.0"
