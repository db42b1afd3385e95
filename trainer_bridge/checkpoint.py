"""Orbax checkpoints of trainer param trees: locate, inspect, restore onto given shardings.

A checkpoint is either a ``StandardCheckpointer`` directory or a ``CheckpointManager`` root
whose numbered step directories hold the params (as the manager's ``default`` item).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from .tree import flatten_params, unflatten_params


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not match what it is restored into."""


def resolve_checkpoint(path: str | Path, step: int | None = None) -> Path:
    """The directory holding the param tree: ``path`` itself, or step ``step`` (default the
    latest) of a CheckpointManager root."""
    path = Path(path)
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
        raise CheckpointError(f"step must be an int, got {step!r} ({type(step).__name__})")
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory")
    steps = sorted(int(p.name) for p in path.iterdir() if p.is_dir() and p.name.isdigit())
    if steps:
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise CheckpointError(f"checkpoint root {path} has no step {step}; it has steps {steps}")
        path = path / str(step)
    elif step is not None:
        raise CheckpointError(
            f"{path} is a single checkpoint, not a CheckpointManager root: step={step} does not apply"
        )
    if (path / "default").is_dir():
        path = path / "default"
    return path


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def checkpoint_tree_metadata(item_dir: Path) -> dict:
    """The saved tree with each leaf's metadata (shape, dtype), without reading any array."""
    try:
        metadata = _checkpointer().metadata(item_dir)
    except Exception as exc:  # orbax raises a variety of types for unreadable metadata
        raise CheckpointError(f"cannot read checkpoint metadata in {item_dir}: {exc}") from exc
    item = getattr(metadata, "item_metadata", metadata)
    tree = getattr(item, "tree", item)
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"checkpoint {item_dir} does not hold a tree of arrays")
    return dict(tree)


def restore_tree(item_dir: Path, target: Any) -> Any:
    """Restore the tree at ``item_dir`` as ``target`` says (a tree of ``jax.ShapeDtypeStruct``
    with shardings, or of arrays whose shape, dtype and sharding to take)."""
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target)
    try:
        return _checkpointer().restore(item_dir, abstract)
    except Exception as exc:
        raise CheckpointError(f"cannot restore checkpoint {item_dir}: {_restore_failure(exc)}") from exc


def _restore_failure(exc: BaseException) -> str:
    """What a failed restore says, without the TensorStore spec (60 lines) orbax appends: its
    own words, then the error it wraps, which names the array read ("a/0.0")."""
    words = str(exc).split(" See full TensorStore details")[0]
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    if cause is not exc:
        words += f" ({type(cause).__name__}: {cause})"
    return words


def restore_params(path: str | Path, target: Mapping, *, step: int | None = None) -> dict:
    """Restore a trainer param tree onto the trainer's own shardings (to resume training).

    ``target`` is the trainer's param tree (arrays or ShapeDtypeStructs) in the saved layout
    (with or without a ``{'params': ...}`` wrapper, as it was saved).
    """
    item_dir = resolve_checkpoint(path, step)
    saved = flatten_params(checkpoint_tree_metadata(item_dir))
    wanted = flatten_params(target)
    missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint {item_dir} does not match the target tree: missing {missing[:8]}, unexpected {extra[:8]}"
        )
    for key, leaf in wanted.items():
        if tuple(saved[key].shape) != tuple(leaf.shape):
            raise CheckpointError(
                f"checkpoint {item_dir}: '{key}' has shape {tuple(saved[key].shape)}, expected {tuple(leaf.shape)}"
            )
        if jnp.issubdtype(saved[key].dtype, jnp.floating) != jnp.issubdtype(leaf.dtype, jnp.floating):
            # A restore casts to the target's dtype: integers would come back as weights, silently.
            raise CheckpointError(f"checkpoint {item_dir}: '{key}' has dtype {saved[key].dtype}, expected {leaf.dtype}")
    return restore_tree(item_dir, target)


def saved_layout(item_dir: Path) -> tuple[dict, bool]:
    """(flat path -> leaf metadata, whether the tree is wrapped as {'params': ...})."""
    tree = checkpoint_tree_metadata(item_dir)
    return flatten_params(tree), set(tree) == {"params"}


def wrap_like(flat: Mapping[str, Any], wrapped: bool) -> dict:
    tree = unflatten_params(flat)
    return {"params": tree} if wrapped else tree
