"""In-process sglang-jax rollout worker for JAX/Flax RL trainers."""

from .versions import UnsupportedVersionError, check_versions

# Before anything imports jax or the engine: a version outside the supported ranges is one clear
# error rather than a failure deep inside sglang-jax.
check_versions()

from .batch import RolloutBatch  # noqa: E402
from .config import WorkerConfig  # noqa: E402
from .engine import EngineError, UnsupportedEngineVersion  # noqa: E402
from .worker import KvReport, MemoryReport, RolloutWorker  # noqa: E402

__all__ = ["EngineError", "KvReport", "MemoryReport", "RolloutBatch", "RolloutWorker", "UnsupportedEngineVersion", "UnsupportedVersionError", "WorkerConfig"]
