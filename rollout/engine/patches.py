"""The sglang-jax 0.0.2 workarounds: what is patched, why, and the process-state guard."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np

from .runtime import run_detokenizer_thread, start_scheduler_thread, watchdog_thread
from .types import SUPPORTED_ENGINE_VERSION, UnsupportedEngineVersion

WORKAROUNDS: dict[str, str] = {
    "duplicate-pytree-registration": (
        "layers/attention/native_backend.py registers NativeAttention as a pytree although nnx "
        "already registers every Module subclass: importing it raises 'Duplicate custom "
        "PyTreeDef type registration'. It is imported here with the duplicate registration "
        "skipped."
    ),
    "min-p-operands": (
        "Off TPU, layers/sampler.py passes 3 operands to _apply_min_p_filter, which unpacks 2; "
        "lax.cond traces it even for greedy decoding, so every sampled request crashes. "
        "Replaced by a filter that takes either form."
    ),
    "sampler-rng": (
        "The sampler's RNG state is frozen inside a functools.partial, so every call and every "
        "step reuses one key: temperature sampling repeats itself. The engine's own seeded "
        "path (enable_deterministic_sampling) uses a weak integer hash and, off TPU, takes a "
        "softmax of probabilities, which flattens the distribution. Deterministic sampling is "
        "always on, every request gets its own seed, and each token is drawn with "
        "jax.random.categorical under a key folded from (seed, position): fresh samples per "
        "call, the same samples for the same seed, independent of how requests are batched."
    ),
    "process-kill-on-error": (
        "An exception in the scheduler or detokenizer thread, a failed scheduler start, or the "
        "watchdog sends SIGQUIT, whose handler kills the whole process tree (and the watchdog "
        "signals the parent process). Engine.shutdown kills every child process of the caller. "
        "Here the threads run under guards that record the error and fail the waiting caller "
        "with EngineError; no signal handler is installed and shutdown is done by hand."
    ),
    "idle-busy-spin": (
        "The idle scheduler loop polls its sockets without blocking: one core at 100%. The "
        "loop now blocks in a zmq poll while idle, woken by requests or queued calls."
    ),
    "process-global-side-effects": (
        "Engine start-up forces the root logger to its level (basicConfig(force=True)), reseeds "
        "numpy and random, installs uvloop's event-loop policy, SIGCHLD/SIGQUIT/SIGTERM "
        "handlers and an atexit hook, disables the multiprocessing resource tracker, and "
        "disables threading's atexit registration. Each is prevented or undone."
    ),
    "untied-head-dtype": (
        "Untied models (tie_word_embeddings false) create lm_head with the default param dtype "
        "bfloat16 and compute logits in it whatever the model dtype. The head's dtype and "
        "weight are set to the model dtype before the first forward is compiled."
    ),
    "detokenizer-output-ids": (
        "With a tokenizer loaded, the detokenizer path returns output_ids that silently drop "
        "special tokens (EOS mid-sequence under ignore_eos, a matched stop token), so "
        "len(output_ids) < completion_tokens. The engine always runs with skip_tokenizer_init "
        "and exact token ids; the worker encodes prompts and decodes completions itself."
    ),
    "shared-hf-config": (
        "hf_transformers_utils.get_config caches the HF config object per model path, and "
        "ModelConfig.configure_for_tensor_parallel mutates it (KV heads replicated for tp): a "
        "second engine on the same model dir in one process starts from the mutated config "
        "and crashes in its first forward ('Incompatible shapes for broadcasting'). The cache "
        "is cleared before every engine start."
    ),
    "flush-cache": (
        "Engine.flush_cache and release/resume_memory_occupation raise TypeError and the "
        "scheduler has no handler for them. Cache flush and KV drop/rebuild are done directly "
        "on the scheduler thread."
    ),
}

# Switches workarounds off for a process, to check whether a newer sglang-jax still needs one:
# ROLLOUT_DISABLE_WORKAROUNDS=min-p-operands,flush-cache. The pinning test of each must then
# fail (tests/test_engine_workarounds.py checks that it does, in a subprocess per workaround).
DISABLE_ENV = "ROLLOUT_DISABLE_WORKAROUNDS"

logger = logging.getLogger(__name__)


def disabled_workarounds() -> frozenset[str]:
    """The workarounds that ``ROLLOUT_DISABLE_WORKAROUNDS`` (comma-separated names) switches off."""
    names = {name.strip() for name in os.environ.get(DISABLE_ENV, "").split(",") if name.strip()}
    unknown = sorted(names - set(WORKAROUNDS))
    if unknown:
        raise ValueError(f"{DISABLE_ENV} names unknown workaround(s) {unknown}; known: {sorted(WORKAROUNDS)}")
    return frozenset(names)


def workaround_enabled(name: str) -> bool:
    if name not in WORKAROUNDS:
        raise KeyError(f"no workaround named {name!r}")
    return name not in disabled_workarounds()


_install_lock = threading.Lock()
_installed = False


def engine_version() -> str:
    from sgl_jax.version import __version__

    return __version__


def install_workarounds() -> None:
    """Import sglang-jax with the 0.0.2 workarounds applied. Idempotent, process-wide."""
    global _installed
    with _install_lock:
        if _installed:
            return
        version = engine_version()
        if version != SUPPORTED_ENGINE_VERSION:
            raise UnsupportedEngineVersion(
                f"sglang-jax {version} is installed; this release of sglang-jax-rollout knows the "
                f"internals of sglang-jax=={SUPPORTED_ENGINE_VERSION} only"
            )
        if disabled_workarounds():
            logger.warning("sglang-jax workarounds disabled (%s): %s", DISABLE_ENV, sorted(disabled_workarounds()))
        if workaround_enabled("duplicate-pytree-registration"):
            _import_native_backend_without_duplicate_registration()
        else:
            import sgl_jax.srt.layers.attention.native_backend  # noqa: F401
        with preserved_process_state():
            # Importing the entrypoint installs uvloop's policy and rebinds
            # threading._register_atexit; the guard puts both back.
            import sgl_jax.srt.entrypoints.engine as engine_module
        _patch_sampler()
        _patch_start_up(engine_module)
        _installed = True


def _import_native_backend_without_duplicate_registration() -> None:
    from flax import nnx

    original = jax.tree_util.register_pytree_node_class

    def register_unless_nnx_module(cls):
        # nnx registers every Module subclass itself; a second registration raises.
        if isinstance(cls, type) and issubclass(cls, nnx.Module):
            return cls
        return original(cls)

    jax.tree_util.register_pytree_node_class = register_unless_nnx_module
    try:
        import sgl_jax.srt.layers.attention.native_backend  # noqa: F401
    finally:
        jax.tree_util.register_pytree_node_class = original


def _apply_min_p_filter(operands):
    # The engine passes (probs, min_ps) on TPU and (probs, min_ps, unused) elsewhere.
    probs, min_ps = operands[0], operands[1]
    thresholds = jnp.max(probs, axis=1) * min_ps
    return jnp.where(probs < thresholds.reshape(-1, 1), 0.0, probs)


def _keyed_categorical(operands):
    """Draw one token per row with a key folded from (row seed, row position).

    The engine hands this branch logits on TPU and (sorted, filtered) probabilities elsewhere;
    ``sampler.multinomial`` makes the same distinction.
    """
    from sgl_jax.srt.layers import sampler
    from sgl_jax.srt.utils.jax_utils import is_tpu_runtime

    scores, seeds, positions, _ = operands
    if seeds is None:
        return sampler.multinomial(operands)
    logits = scores if is_tpu_runtime() else jnp.log(scores)
    base = jax.random.key(0)

    def draw(seed, position, row_logits):
        key = jax.random.fold_in(jax.random.fold_in(base, seed), position)
        return jax.random.categorical(key, row_logits)

    rows = jax.vmap(draw)(seeds.astype(jnp.uint32), positions.astype(jnp.uint32), logits)
    return rows.reshape(-1, 1)


def _patch_sampler() -> None:
    from sgl_jax.srt.layers import sampler

    if workaround_enabled("min-p-operands"):
        sampler._apply_min_p_filter = _apply_min_p_filter
    if workaround_enabled("sampler-rng"):
        sampler.multinomial_with_seed = _keyed_categorical


def _patch_start_up(engine_module) -> None:
    from sgl_jax.srt.managers import detokenizer_manager, scheduler

    def leave_logging_alone(*args, **kwargs):
        return None

    if workaround_enabled("process-global-side-effects"):
        for module in (engine_module, scheduler, detokenizer_manager):
            module.configure_logger = leave_logging_alone
    # The scheduler, detokenizer and watchdog threads are always this package's (queued calls
    # run on the scheduler thread; close() stops the others). With process-kill-on-error
    # disabled, the scheduler loop runs under the engine's own error handling and the engine
    # installs its signal handlers and exit hook.
    engine_module.run_scheduler_loop_thread_after_create = start_scheduler_thread
    engine_module.run_detokenizer_thread = run_detokenizer_thread
    scheduler.Scheduler.watchdog_thread = watchdog_thread
    if workaround_enabled("process-kill-on-error"):
        # No SIGCHLD/SIGQUIT handlers, no ulimit change, resource tracker left alone.
        engine_module._set_envs_and_config = lambda server_args: None
        # Engine.__init__ registers its process-tree-killing shutdown at exit, even when start-up
        # then fails; EngineHandle.close does the shutdown instead.
        engine_module.atexit = types.SimpleNamespace(register=lambda *args, **kwargs: None)


@contextlib.contextmanager
def preserved_process_state():
    """Put back the process-global state that engine import and start-up change."""
    if not workaround_enabled("process-global-side-effects"):
        yield
        return
    root = logging.getLogger()
    root_level, root_handlers = root.level, list(root.handlers)
    numpy_state = np.random.get_state()
    random_state = random.getstate()
    policy = asyncio.get_event_loop_policy()
    register_atexit = threading._register_atexit
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGCHLD, signal.SIGQUIT, signal.SIGTERM):
            handlers[sig] = signal.getsignal(sig)
    try:
        yield
    finally:
        root.setLevel(root_level)
        root.handlers[:] = root_handlers
        np.random.set_state(numpy_state)
        random.setstate(random_state)
        asyncio.set_event_loop_policy(policy)
        threading._register_atexit = register_atexit
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
