"""The sglang-jax 0.0.2 workarounds: what is patched, why, and the process-state guard."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np

from .attention import paged_attention
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
    "native-attention-memory": (
        "The native attention backend (the one used off TPU) gathers every slot of cache_loc, "
        "which is padded to max_running_requests x context_length, and builds logits against "
        "all of them for every token: a prefill chunk of a real model config asks for hundreds "
        "of GB, and decode is slow. It also locates requests in cache_loc without the page "
        "rounding the scheduler uses, so page_size > 1 attends to the wrong slots. Replaced by "
        "attention.paged_attention: each query block walks only its own requests' slots in "
        "fixed chunks with an online softmax (memory ~ tokens x chunk), same results."
    ),
}



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
        _import_native_backend_without_duplicate_registration()
        with preserved_process_state():
            # Importing the entrypoint installs uvloop's policy and rebinds
            # threading._register_atexit; the guard puts both back.
            import sgl_jax.srt.entrypoints.engine as engine_module
        _patch_sampler()
        _patch_start_up(engine_module)
        _patch_native_attention()
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

    sampler._apply_min_p_filter = _apply_min_p_filter
    sampler.multinomial_with_seed = _keyed_categorical


def _patch_start_up(engine_module) -> None:
    from sgl_jax.srt.managers import detokenizer_manager, scheduler

    def leave_logging_alone(*args, **kwargs):
        return None

    for module in (engine_module, scheduler, detokenizer_manager):
        module.configure_logger = leave_logging_alone
    # No SIGCHLD/SIGQUIT handlers, no ulimit change, resource tracker left alone.
    engine_module._set_envs_and_config = lambda server_args: None
    # Engine.__init__ registers its process-tree-killing shutdown at exit, even when start-up
    # then fails; EngineHandle.close does the shutdown instead.
    engine_module.atexit = types.SimpleNamespace(register=lambda *args, **kwargs: None)
    engine_module.run_scheduler_loop_thread_after_create = start_scheduler_thread
    engine_module.run_detokenizer_thread = run_detokenizer_thread
    scheduler.Scheduler.watchdog_thread = watchdog_thread


_native_attention_baseline = False


@contextlib.contextmanager
def engine_native_attention():
    """Forwards compiled inside this block use 0.0.2's own native attention, not the paged one.

    The baseline for parity tests and benchmarks. The choice is made when an engine's forward is
    traced (its first generate, or start-up with precompile), so keep the engine's work inside.
    """
    global _native_attention_baseline
    previous, _native_attention_baseline = _native_attention_baseline, True
    try:
        yield
    finally:
        _native_attention_baseline = previous


def _patch_native_attention() -> None:
    from sgl_jax.srt.layers.attention import native_backend
    from sgl_jax.srt.layers.radix_attention import AttentionType
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode

    engine_call = native_backend.NativeAttention.__call__

    def paged_call(self, q, k, v, layer, forward_batch, token_to_kv_pool):
        if _native_attention_baseline:
            return engine_call(self, q, k, v, layer, forward_batch, token_to_kv_pool)
        # The engine's own KV write; the fused layer it returns is what the caller persists.
        _, _, kv_fused = self._get_and_update_kv_cache(
            k, v, forward_batch, token_to_kv_pool, layer.layer_id
        )
        mode = forward_batch.forward_mode
        # The same mode dispatch as the engine's forward_attention: EXTEND or decode-like.
        extend = mode == ForwardMode.EXTEND
        output = paged_attention(
            q,
            kv_fused,
            forward_batch.cache_loc,
            forward_batch.seq_lens,
            forward_batch.extend_prefix_lens if extend else None,
            forward_batch.extend_seq_lens if extend else None,
            num_heads=layer.q_head_num,
            num_kv_heads=layer.kv_head_num,
            scale=layer.head_dim**-0.5 if layer.scaling is None else layer.scaling,
            causal=mode != ForwardMode.DECODE and layer.attn_type != AttentionType.ENCODER_ONLY,
            page_size=token_to_kv_pool.page_size,
        )
        return output, kv_fused

    native_backend.NativeAttention.__call__ = paged_call


@contextlib.contextmanager
def preserved_process_state():
    """Put back the process-global state that engine import and start-up change."""
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
