"""Trainer param trees -> engine weights: mapping plans, zero-copy sync, checkpoint loading."""

from .checkpoint import (
    CheckpointError,
    checkpoint_tree_metadata,
    resolve_checkpoint,
    restore_params,
    restore_tree,
    saved_layout,
    wrap_like,
)
from .hf import load_hf_params, safetensors_files
from .lora import (
    DEFAULT_TARGET_MODULES,
    FACTOR_NAMES,
    Adapter,
    LoraConfig,
    apply_adapters,
    collect_adapters,
    init_adapters,
    merge_adapters,
)
from .sync import (
    EngineLeaf,
    LeafAction,
    LeafPlan,
    SyncError,
    SyncPlan,
    SyncReport,
    build_plan,
    non_finite_leaves,
    plan_key,
    relabel,
)
from .tree import flatten_params, unflatten_params, unwrap_params

__all__ = [
    "Adapter",
    "DEFAULT_TARGET_MODULES",
    "FACTOR_NAMES",
    "LoraConfig",
    "apply_adapters",
    "collect_adapters",
    "init_adapters",
    "merge_adapters",
    "CheckpointError",
    "checkpoint_tree_metadata",
    "resolve_checkpoint",
    "restore_params",
    "restore_tree",
    "saved_layout",
    "wrap_like",
    "EngineLeaf",
    "LeafAction",
    "LeafPlan",
    "SyncError",
    "SyncPlan",
    "SyncReport",
    "build_plan",
    "flatten_params",
    "load_hf_params",
    "non_finite_leaves",
    "plan_key",
    "relabel",
    "safetensors_files",
    "unflatten_params",
    "unwrap_params",
]
