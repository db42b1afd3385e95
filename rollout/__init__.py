"""In-process sglang-jax rollout worker for JAX/Flax RL trainers."""

from .batch import RolloutBatch
from .config import WorkerConfig
from .consistency import ConsistencyError, ConsistencyReport, TokenMismatch, check_consistency, mismatch_stats
from .engine import EngineError, UnsupportedEngineVersion
from .worker import KvReport, MemoryReport, RolloutWorker

__all__ = [
    "ConsistencyError",
    "ConsistencyReport",
    "EngineError",
    "KvReport",
    "MemoryReport",
    "RolloutBatch",
    "RolloutWorker",
    "TokenMismatch",
    "UnsupportedEngineVersion",
    "WorkerConfig",
    "check_consistency",
    "mismatch_stats",
]
