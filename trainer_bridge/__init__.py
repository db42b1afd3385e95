"""Trainer param trees -> engine weights: mapping plans, zero-copy sync, checkpoint loading.

What a trainer uses is here; the sync plans, adapter merging and checkpoint layouts that the
worker builds on are in the submodules (``sync``, ``lora``, ``checkpoint``, ``hf``, ``tree``)."""

from .checkpoint import CheckpointError, checkpoint_tree_metadata, restore_params, restore_tree
from .hf import load_hf_params
from .lora import DEFAULT_TARGET_MODULES, Adapter, LoraConfig, apply_adapters, init_adapters
from .sync import SyncError, SyncReport, non_finite_leaves, replicate, replicated_beside
from .tree import flatten_params, unflatten_params

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "Adapter",
    "CheckpointError",
    "LoraConfig",
    "SyncError",
    "SyncReport",
    "apply_adapters",
    "checkpoint_tree_metadata",
    "flatten_params",
    "init_adapters",
    "load_hf_params",
    "non_finite_leaves",
    "replicate",
    "replicated_beside",
    "restore_params",
    "restore_tree",
    "unflatten_params",
]
