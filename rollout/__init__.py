"""In-process sglang-jax rollout worker for JAX/Flax RL trainers."""

from .batch import RolloutBatch
from .config import WorkerConfig
from .sglang_engine import EngineError, UnsupportedEngineVersion
from .worker import RolloutWorker

__all__ = ["EngineError", "RolloutBatch", "RolloutWorker", "UnsupportedEngineVersion", "WorkerConfig"]
