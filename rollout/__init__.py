"""In-process sglang-jax rollout worker for JAX/Flax RL trainers."""

from .versions import UnsupportedVersionError, check_versions

# Before anything imports jax or the engine: a version outside the supported ranges is one clear
# error rather than a failure deep inside sglang-jax.
check_versions()

from .in_place_updates import disable_xnnpack_dots  # noqa: E402

# Before JAX creates its CPU backend, which reads XLA_FLAGS once (rollout/in_place_updates.py).
disable_xnnpack_dots()

from .batch import RolloutBatch, StreamChunk  # noqa: E402
from .compiles import compile_count, counting_compiles  # noqa: E402
from .config import WorkerConfig  # noqa: E402
from .consistency import (  # noqa: E402
    ConsistencyError,
    ConsistencyReport,
    TokenMismatch,
    check_consistency,
    mismatch_stats,
)
from .engine import EngineError  # noqa: E402
from .errors import (  # noqa: E402
    InvalidRequest,
    LimitExceeded,
    PlatformError,
    RolloutError,
    WorkerClosed,
    WorkerUnavailable,
)
from .gate import OwnCallsInFlight  # noqa: E402
from .kv import EngineMemory, KvReport, MemoryReport  # noqa: E402
from .pod import PeerSyncError, PodError  # noqa: E402
from .sampling import SamplingParams  # noqa: E402
from .worker import RolloutWorker  # noqa: E402

__all__ = [
    "ConsistencyError",
    "ConsistencyReport",
    "EngineError",
    "EngineMemory",
    "InvalidRequest",
    "KvReport",
    "LimitExceeded",
    "MemoryReport",
    "OwnCallsInFlight",
    "PeerSyncError",
    "PlatformError",
    "PodError",
    "RolloutBatch",
    "RolloutError",
    "RolloutWorker",
    "SamplingParams",
    "StreamChunk",
    "TokenMismatch",
    "UnsupportedVersionError",
    "WorkerClosed",
    "WorkerConfig",
    "WorkerUnavailable",
    "check_consistency",
    "compile_count",
    "counting_compiles",
    "mismatch_stats",
]
