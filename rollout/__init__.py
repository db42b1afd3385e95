"""In-process sglang-jax rollout worker for JAX/Flax RL trainers."""

from .batch import RolloutBatch
from .config import WorkerConfig
from .engine import EngineError, UnsupportedEngineVersion
from .worker import KvReport, MemoryReport, RolloutWorker

__all__ = ["EngineError", "KvReport", "MemoryReport", "RolloutBatch", "RolloutWorker", "UnsupportedEngineVersion", "WorkerConfig"]
