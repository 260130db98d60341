"""minigen: how a large language model generates text fast, one readable step at a time."""

from .config import GenerationConfig
from .errors import CacheFullError, ConfigError, MinigenError, ModelLoadError, PromptError
from .generate import GenerationOutput, GenerationStats, decode_step, generate, prefill, sample, stream
from .loading import from_hf, load
from .metrics import perplexity, score, top1_agreement
from .model import Model, ModelConfig

__all__ = ["GenerationConfig", "GenerationOutput", "GenerationStats", "Model", "ModelConfig",
           "CacheFullError", "ConfigError", "MinigenError", "ModelLoadError", "PromptError",
           "decode_step", "from_hf", "generate", "load", "perplexity", "prefill", "sample", "score",
           "stream", "top1_agreement"]
__version__ = "0.1.0"
