"""In-process sglang-jax rollout worker for JAX/Flax RL trainers."""

from .batch import RolloutBatch, StreamChunk
from .compiles import compile_count, counting_compiles
from .config import WorkerConfig
from .consistency import ConsistencyError, ConsistencyReport, TokenMismatch, check_consistency, mismatch_stats
from .engine import EngineError, UnsupportedEngineVersion
from .kv import EngineMemory, KvReport, MemoryReport
from .sampling import SamplingParams
from .worker import RolloutWorker

__all__ = [
    "ConsistencyError",
    "ConsistencyReport",
    "EngineError",
    "EngineMemory",
    "KvReport",
    "MemoryReport",
    "RolloutBatch",
    "RolloutWorker",
    "SamplingParams",
    "StreamChunk",
    "TokenMismatch",
    "UnsupportedEngineVersion",
    "WorkerConfig",
    "check_consistency",
    "compile_count",
    "counting_compiles",
    "mismatch_stats",
]
