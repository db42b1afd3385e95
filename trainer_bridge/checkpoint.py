"""Orbax checkpoints of trainer param trees: locate, inspect, restore onto given shardings.

A checkpoint is either a ``StandardCheckpointer`` directory or a ``CheckpointManager`` root
whose numbered step directories (``7``, ``00000007``, ``step_7``) hold the params (as the
manager's ``default`` item, or an item named ``params``). The tree saved is the params, the
params under ``{'params': ...}``, or a train state holding them under ``'params'`` beside other
items (``{'params', 'opt_state', 'step'}``, as the RL examples save), whose params alone are read.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import numbers
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from .tree import flatten_params, unwrap_params

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not match what it is restored into."""


# A CheckpointManager's step directory: the step, zero-padded or not, after an optional prefix
# (``step_format_fixed_length``, ``step_prefix``); never its temporary directories.
_STEP_NAME = re.compile(r"(?:(.+)_)?([0-9]+)")
# Files of a single checkpoint's own directory (orbax's tree metadata).
_CHECKPOINT_FILES = ("_METADATA", "_sharding", "manifest.ocdbt")


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
    steps: dict[int, Path] = {}
    single = any((path / name).is_file() for name in _CHECKPOINT_FILES)  # its folders are leaves, not steps
    for child in [] if single else path.iterdir():
        number = _STEP_NAME.fullmatch(child.name)
        # A prefixed name (step_prefix) counts where orbax wrote a step there: not tensorboard_5/.
        if child.is_dir() and number and (number[1] is None or (child / "_CHECKPOINT_METADATA").is_file()):
            if int(number[2]) in steps:
                raise CheckpointError(f"checkpoint root {path} has two directories of step {int(number[2])}")
            steps[int(number[2])] = child
    if steps:
        if step is None:
            step = max(steps)
            # An empty step directory (a save cut off before it wrote anything) is passed over.
            written = [number for number, directory in steps.items() if any(directory.iterdir())]
            if written and max(written) != step:
                logger.warning(
                    "checkpoint root %s: the directory of step %d is empty; reading step %d, the latest written",
                    path,
                    step,
                    max(written),
                )
                step = max(written)
        elif step not in steps:
            raise CheckpointError(f"checkpoint root {path} has no step {step}; it has steps {sorted(steps)}")
        path = steps[step]
    elif step is not None:
        raise CheckpointError(
            f"{path} is a single checkpoint, not a CheckpointManager root: step={step} does not apply"
        )
    for item in ("default", "params"):  # a manager's one unnamed item, or its item of that name
        if (path / item).is_dir():
            return path / item
    items = sorted(child.name for child in path.iterdir() if (child / "_METADATA").is_file())
    if items and not any((path / name).is_file() for name in _CHECKPOINT_FILES):
        raise CheckpointError(
            f"checkpoint {path} holds the items {items}, none named 'default' or 'params' (where the params "
            f"are read from): pass the directory of the item that holds them, such as {path / items[0]}"
        )
    return path


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


# Whether this thread is in one of our reads (orbax's run_sync is wrapped for them alone).
_reading = threading.local()
_wrap_lock = threading.Lock()
# How long a failed read waits for the reads still in flight before it cancels them.
_SETTLE_S = 120.0


async def _settled(coro):
    """``coro``; on its failure, the event loop's other tasks run to their end before the error
    goes on. orbax reads the arrays in tasks of their own and gathers them: the first read that
    fails ends the gather while the others are still in flight, and orbax then closes the loop
    under them. Left so, TensorStore's reads completed onto a closed loop ("RuntimeError: Event
    loop is closed", from its threads), and once collected (at a later gc, at exit) asyncio
    logged "_GatheringFuture exception was never retrieved" and Python "Exception ignored in:
    <coroutine _read_array_index_and_device_put>", each with orbax's TensorStore spec (60 lines).

    The other reads are waited for, not cancelled: a cancelled task ends at once while its
    TensorStore read goes on and completes onto the closed loop all the same. So a failed restore
    takes at most as long as a whole one; after ``_SETTLE_S`` what is left is cancelled."""
    try:
        return await coro
    except Exception:  # not an interrupt (Ctrl-C goes on at once) nor the coroutine's close
        this, loop = asyncio.current_task(), asyncio.get_running_loop()
        deadline = loop.time() + _SETTLE_S
        # A task that ends may have started others (a nested gather's reads): until none is left.
        while left := [task for task in asyncio.all_tasks() if task is not this]:
            _, late = await asyncio.wait(left, timeout=max(deadline - loop.time(), 0))
            for task in late:
                task.cancel()
            # Their outcomes (orbax's "Encountered error while reading ...") are retrieved here:
            # the same failure, which the caller gets once.
            await asyncio.gather(*left, return_exceptions=True)
        raise


def _run_sync_settling(run_sync):
    # Whatever else a later orbax passes goes through as it is.
    def run_sync_settling(coro, *args, **kwargs):
        return run_sync(_settled(coro) if getattr(_reading, "active", False) else coro, *args, **kwargs)

    run_sync_settling.wrapped = run_sync
    return run_sync_settling


@contextlib.contextmanager
def _reads_settled():
    """Within: this thread's orbax reads leave nothing running when they fail (``_settled``).
    orbax's ``run_sync`` is wrapped once, process-wide, but changes nothing outside this block
    (another thread's saves, the trainer's own restores). An orbax without that private module
    or ``run_sync`` reads as it would."""
    try:
        from orbax.checkpoint._src import asyncio_utils
    except ImportError:
        asyncio_utils = None
    with _wrap_lock:
        run_sync = getattr(asyncio_utils, "run_sync", None)
        if run_sync is not None and not hasattr(run_sync, "wrapped"):
            asyncio_utils.run_sync = _run_sync_settling(run_sync)
    outer = getattr(_reading, "active", False)
    _reading.active = True
    try:
        yield
    finally:
        _reading.active = outer


def checkpoint_tree_metadata(item_dir: Path) -> dict:
    """The saved tree with each leaf's metadata (shape, dtype), without reading any array."""
    try:
        with _reads_settled():
            metadata = _checkpointer().metadata(item_dir)
    except Exception as exc:  # orbax raises a variety of types for unreadable metadata
        raise CheckpointError(f"cannot read checkpoint metadata in {item_dir}: {exc}") from exc
    item = getattr(metadata, "item_metadata", metadata)
    tree = getattr(item, "tree", item)
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"checkpoint {item_dir} does not hold a tree of arrays")
    return dict(tree)


def restore_tree(item_dir: Path, target: Any, *, partial: bool = False) -> Any:
    """Restore the tree at ``item_dir`` as ``target`` says (a tree of ``jax.ShapeDtypeStruct``
    with shardings, or of arrays whose shape, dtype and sharding to take; a leaf with no sharding,
    such as a numpy array, is restored as orbax places it); ``partial``: only the subtrees
    ``target`` has (orbax's partial restore: the rest is not read)."""
    import orbax.checkpoint as ocp

    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), target
    )
    try:
        with _reads_settled():
            if not partial:
                return _checkpointer().restore(item_dir, abstract)
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
            args = ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args, partial_restore=True)
            return ocp.PyTreeCheckpointer().restore(item_dir, args=args)
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

    ``target`` is the trainer's param tree (arrays or ShapeDtypeStructs), with or without a
    ``{'params': ...}`` wrapper (the result has the same); the checkpoint may be a train state
    (its params alone are read). Leaves with no sharding (numpy arrays) are restored as orbax
    places them.
    """
    item_dir = resolve_checkpoint(path, step)
    layout = saved_layout(item_dir)
    saved = layout.flat
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
    # Nested as the target nests them (a key of the target's own may hold a '.').
    params = _as_saved(restore_saved(item_dir, layout, wanted), _saved_keys(unwrap_params(target)))
    return {"params": params} if unwrap_params(target) is not target else params


@dataclasses.dataclass(frozen=True)
class SavedLayout:
    """Where a checkpoint keeps its params: ``flat`` (flat path -> leaf metadata), how many
    ``'params'`` keys they are under (``{'params': {'params': ...}}``: flax's variables in a
    TrainState), and whether anything else is saved beside them (a train state: the params are
    read alone, by a partial restore); ``keys``: each flat path's keys in the saved tree (a
    tree saved flat, ``{'model.norm.scale': ...}``, has one key a leaf)."""

    flat: dict
    depth: int
    beside_others: bool
    keys: dict


def saved_layout(item_dir: Path) -> SavedLayout:
    tree, depth, beside = checkpoint_tree_metadata(item_dir), 0, False
    while isinstance(tree.get("params"), Mapping):
        beside = beside or set(tree) != {"params"}
        tree, depth = tree["params"], depth + 1
    # (flatten_params would take one more {'params': ...} off; there is none left.)
    return SavedLayout(flatten_params(tree), depth, beside, _saved_keys(tree))


def _saved_keys(tree: Mapping, keys: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    """Each leaf's flat path in ``tree`` -> its keys there."""
    found = {}
    for key, node in tree.items():
        if isinstance(node, Mapping):
            found.update(_saved_keys(node, (*keys, key)))
        else:
            found[".".join((*keys, key))] = (*keys, key)
    return found


def _as_saved(targets: Mapping[str, Any], keys: Mapping[str, tuple[str, ...]]) -> dict:
    """``targets`` (flat path -> leaf) nested as the checkpoint nests them: orbax matches a
    restore's target to the saved tree's structure, key by key."""
    tree: dict = {}
    for path, target in targets.items():
        *parents, leaf = keys.get(path, path.split("."))
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = target
    return tree


def restore_saved(item_dir: Path, layout: SavedLayout, targets: Mapping[str, Any]) -> dict:
    """The params of the checkpoint at ``item_dir`` restored as ``targets`` say (flat path ->
    ``jax.ShapeDtypeStruct`` with a sharding), the train state's other items left unread; the
    params alone, flat (path -> array), out of their ``{'params': ...}`` wrappers."""
    target = _as_saved(targets, layout.keys)
    for _ in range(layout.depth):
        target = {"params": target}
    restored = restore_tree(item_dir, target, partial=layout.beside_others)
    for _ in range(layout.depth):
        restored = restored["params"]
    # A partial restore gives a leaf it did not find as the target's own stand-in, silently.
    flat = flatten_params(restored)
    unread = [path for path, leaf in flat.items() if isinstance(leaf, jax.ShapeDtypeStruct)]
    if unread:
        raise CheckpointError(f"checkpoint {item_dir}: {len(unread)} leaves were not found where read: {unread[:8]}")
    return flat
