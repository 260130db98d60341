"""The errors minigen raises: each names the problem and the fix.

They subclass ValueError (or RuntimeError for a full cache) so that callers who only catch the
builtin types still catch them. docs/bad_inputs.md lists the bad inputs and what each one gets.
"""


class MinigenError(Exception):
    """Base class of every error that minigen raises on purpose."""


class ConfigError(MinigenError, ValueError):
    """A GenerationConfig field or a generation_config.json is invalid."""


class PromptError(MinigenError, ValueError):
    """The prompt is empty, malformed, or does not fit the model's context."""


class ModelLoadError(MinigenError, ValueError):
    """A checkpoint is missing, corrupt, mismatched or of an unsupported architecture."""


class CacheFullError(MinigenError, RuntimeError):
    """A write went past the tokens that the KV cache was allocated for."""


# The memory planner (plan.py), named by every CacheFullError: it lists the cache settings that fit.
PLAN_HINT = ("To see which cache settings fit your memory: python -m minigen plan --model NAME --batch B "
             "--context N --budget-bytes X")


class PositionError(MinigenError, ValueError):
    """Positions a cache cannot take: negative, not consecutive, or already freed."""


class LedgerError(MinigenError, ValueError):
    """The claims ledger (claims.toml) is unreadable or an entry is malformed."""


class BenchError(MinigenError, ValueError):
    """A benchmark that cannot give a meaningful number, or whose results cannot be written."""


class DeployError(MinigenError, ValueError):
    """A deployment file (Triton config.pbtxt, model repository, Kubernetes manifest) is invalid."""

class QueueFullError(MinigenError, RuntimeError):
    """A bounded request queue (batching.RequestQueue) is full: the request was refused, not dropped."""


class RequestError(MinigenError, ValueError):
    """A serving engine's request id that is unknown, or already finished or cancelled."""


class RankError(MinigenError, RuntimeError):
    """A rank of a tensor-parallel group failed, died or ran past its timeout; the others were stopped."""
