"""The sglang-jax 0.0.2 workarounds (listed in ``workarounds.WORKAROUNDS``): the patches
themselves, installed once per process, and the process-state guard."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import random
import signal
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config as jax_config

from models import sampled_token_log_probs, sampling_log_probs, table_logits

from ..versions import ENGINE, UnsupportedVersionError
from .attention import converts_16bit_rows, paged_attention, runs_head_major_dots, set_rows
from .draw import draw_tokens, draw_tokens_and_log_probs, keyed_uniforms, row_argmax_and_max
from .lora import patch_unmerged_lora
from .moe import patch_expert_block
from .multistep import patch_scheduler as patch_decode_chunks
from .multistep import traced_kv_walk
from .programs import engine_compiler_options, forward_cells, jit_with_options, mesh_platform
from .routing import patch_routing_output
from .runtime import run_detokenizer_thread, start_scheduler_thread, watchdog_thread
from .scheduling import patch_scheduling
from .start_up import current_start_up
from .tpu_kernels import patch_kernel_jax_names
from .types import EngineError
from .workarounds import DISABLE_ENV, disabled_workarounds, workaround_enabled

# Scheduler attribute: rid -> list that receives the request's sampled-token log-probs.
LOGPROB_SINKS = "_rollout_logprob_sinks"
# ModelRunner attributes: whether the scheduler's run_batch wrapper wants this step's log-probs,
# and the (log-probs, kept counts) the sampler leaves there for it.
_FETCH_LOGPROBS = "_rollout_fetch_logprobs"
_TOKEN_LOGPROBS = "_rollout_token_logprobs"
# ModelRunner attribute: set while the engine precompiles (every draw's program is compiled then).
_PRECOMPILING = "_rollout_precompiling"
# SamplingMetadata attribute: its batch's (top_ks, top_ps, min_ps, is_all_greedy) on the host.
_HOST_SAMPLING = "_rollout_host_sampling"

logger = logging.getLogger(__name__)

_install_lock = threading.Lock()
_installed = False
# A failure part way through the patches: installing again would patch twice what came before it.
_install_failure: BaseException | None = None


def engine_version() -> str:
    from sgl_jax.version import __version__

    return __version__


def install_workarounds() -> None:
    """Import sglang-jax with the 0.0.2 workarounds applied. Idempotent, process-wide."""
    global _installed, _install_failure
    with _install_lock:
        if _installed:
            return
        if _install_failure is not None:
            raise EngineError(
                f"installing the sglang-jax workarounds failed earlier in this process ({_install_failure!r}); "
                "they are half applied: start a new process"
            ) from _install_failure
        version, (_, supported) = engine_version(), ENGINE
        if version != supported:
            raise UnsupportedVersionError(
                f"sglang-jax {version} is installed; this release of sglang-jax-rollout knows the "
                f"internals of sglang-jax=={supported} only"
            )
        if disabled_workarounds():
            logger.warning("sglang-jax workarounds disabled (%s): %s", DISABLE_ENV, sorted(disabled_workarounds()))
        try:
            _apply_workarounds()
        except BaseException as exc:
            _install_failure = exc
            raise
        _installed = True


def _apply_workarounds() -> None:
    """The patches, in order (each once per process: see install_workarounds)."""
    if workaround_enabled("duplicate-pytree-registration"):
        _import_native_backend_without_duplicate_registration()
    else:
        import sgl_jax.srt.layers.attention.native_backend  # noqa: F401
    with preserved_process_state():
        # Importing the entrypoint installs uvloop's policy and rebinds
        # threading._register_atexit; the guard puts both back.
        import sgl_jax.srt.entrypoints.engine as engine_module
    if workaround_enabled("failure-signal-handler"):
        _import_test_util_keeping_sigterm()
    patch_decode_chunks()  # before the sampler's run_batch wrapper, which wraps it
    _patch_sampler()
    _patch_logits()
    _patch_start_up(engine_module)
    _patch_native_attention()
    patch_expert_block(workaround_enabled)
    patch_kernel_jax_names()
    if workaround_enabled("moe-forward"):  # routing is recorded by this project's expert block
        patch_routing_output()
    _patch_model_loading()
    _patch_model_precision()
    _patch_head_dtype()
    _patch_eos_token_ids()
    _patch_forward_compile_options()
    patch_unmerged_lora()
    patch_scheduling()


def _import_test_util_keeping_sigterm() -> None:
    # The handler is saved and restored as raw bytes with sigaction(2): Python's signal module
    # only sees handlers it installed, and only the main thread may install them.
    libc = ctypes.CDLL(None, use_errno=True)
    saved = ctypes.create_string_buffer(_SIGACTION_BYTES)
    if libc.sigaction(signal.SIGTERM, None, saved) != 0:
        raise OSError(ctypes.get_errno(), "sigaction(SIGTERM) failed")
    import jax._src.test_util  # noqa: F401

    libc.sigaction(signal.SIGTERM, saved, None)


# Larger than struct sigaction on every supported platform (152 bytes on Linux x86-64).
_SIGACTION_BYTES = 512


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


def _uniforms(seeds, positions, rng, rows):
    """One uniform per row, keyed by (row seed, row position) when the rows have seeds."""
    if seeds is None:
        return jax.random.uniform(rng, (rows,))
    return keyed_uniforms(seeds, positions)


def _all_kept(logits):
    return jnp.full((logits.shape[0],), logits.shape[-1], jnp.int32)


def _greedy_with_logprobs(operands):
    logits, temperatures = operands[:2]
    scaled = logits.astype(jnp.float32) / temperatures.reshape(-1, 1)
    ids, peak = row_argmax_and_max(scaled)
    # The max's log-prob: minus the log of the mass (>= 1), never above 0.
    return ids, -jnp.log(jnp.sum(jnp.exp(scaled - peak), axis=-1)), _all_kept(logits)


def _draw_with_logprobs(operands):
    """Sampled ids, their log-probs and how many tokens each row kept (the vocabulary where
    nothing was filtered). When no sampling row filters (top-k, top-p, min-p), the draw reads
    the tempered logits directly in two passes; otherwise the shared filters
    (models.sampling_log_probs) run first. Greedy rows (top_k 1) take the argmax either way."""
    logits, _, top_ks, top_ps, min_ps = operands[:5]
    greedy = top_ks == 1
    filtering = ~greedy & ((top_ks < logits.shape[-1]) | (top_ps < 1.0) | (min_ps > 0.0))
    return jax.lax.cond(jnp.any(filtering), _draw_filtered, _draw_unfiltered, operands)


def _draw_unfiltered(operands):
    """:func:`_draw_with_logprobs` where no row filters: two passes over the tempered logits."""
    logits, temperatures, top_ks, _, _, seeds, positions, rng = operands
    uniforms = _uniforms(seeds, positions, rng, logits.shape[0])
    ids, logprobs = draw_tokens_and_log_probs(logits, uniforms, top_ks == 1, temperatures)
    return ids, logprobs, _all_kept(logits)


def _draw_filtered(operands):
    """:func:`_draw_with_logprobs` where some row filters: the shared filters, then the draw."""
    logits, temperatures, top_ks, top_ps, min_ps, seeds, positions, rng = operands
    uniforms = _uniforms(seeds, positions, rng, logits.shape[0])
    greedy = top_ks == 1
    tempered, kept = sampling_log_probs(logits, temperatures, top_ks, top_ps, min_ps)
    ids = draw_tokens(kept, uniforms, greedy)
    # The trainer applies the same cut from the count (models.completion_log_probs): its own
    # top-p over logits that differ in the last bits could keep one token more or less.
    counts = jnp.sum(jnp.isfinite(kept), axis=-1, dtype=jnp.int32)
    logprobs = sampled_token_log_probs(tempered, kept, ids, top_ks)
    # Greedy rows as in a batch where no row filters: their log-probs and counts must not
    # depend on their neighbours (their top_k of 1 would keep one token here).
    _, greedy_logprobs, all_kept = _greedy_with_logprobs((logits, temperatures))
    return ids, jnp.where(greedy, greedy_logprobs, logprobs), jnp.where(greedy, all_kept, counts)


# The draws a batch can need, by name: its rows all greedy, some sampled and none filtering, or
# some filtering (top-k, top-p, min-p). Each is a program of its own where the host knows which
# (:func:`draw_kind`): the draw that chooses between filtering or not on the device took
# 1.8-2.0 s to compile against 0.3 s for the greedy one and 0.5 s for the unfiltered draw alone
# (8-64 rows, vocabulary 320, jax 0.12 CPU), at every batch size.
_DRAWS = {"greedy": _greedy_with_logprobs, "sample": _draw_unfiltered, "filter": _draw_filtered}
DRAW_KINDS = tuple(_DRAWS)


def _sample(sampler, logits_output, m, positions, draw: str | None = None):
    """(token ids [B], their log-probs [B], kept counts [B]) of a batch's logits, by ``sampler``
    (the engine's ``Sampler``: its RNG); ``draw`` names the draw (:data:`_DRAWS`), or None to
    choose on the device. 0.0.2's penalties (frequency, presence, min-new-tokens) are not
    applied: no request carries them (``requests._sampling_dict`` sends none); serving them would
    need the trainer's log-probs to apply them too."""
    logits = logits_output.next_token_logits
    logits = jnp.reshape(logits, (-1, logits.shape[-1]))
    _, rng = jax.random.split(sampler.rngs.params())
    operands = (logits, m.temperatures, m.top_ks, m.top_ps, m.min_ps, m.sampling_seeds, positions, rng)
    if draw is not None:
        return _DRAWS[draw](operands)
    return jax.lax.cond(m.is_all_greedy, _greedy_with_logprobs, _draw_with_logprobs, operands)


def _sample_with_logprobs(self, logits_output, sampling_metadata, positions, draw: str | None = None):
    """``Sampler.__call__`` replacement: the draw named (a decode chunk's, :func:`draw_kind`),
    or chosen on the device."""
    return _sample(self, logits_output, sampling_metadata, positions, draw)


@functools.partial(jax.jit, static_argnames=("sampler_state_def", "draw"))
def _jitted_draw(sampler_def, sampler_state_def, sampler_leaves, logits_output, metadata, positions, draw):
    """The engine's ``jitted_sampler`` (its arguments), with the draw a static argument."""
    from flax import nnx

    sampler = nnx.merge(sampler_def, jax.tree_util.tree_unflatten(sampler_state_def, sampler_leaves))
    return _sample(sampler, logits_output, metadata, positions, draw)


def draw_kind(metadata, vocab: int) -> str | None:
    """Which of :data:`_DRAWS` a batch needs, from the host copy of its sampling parameters that
    :func:`_metadata_knowing_its_draw` left (None where there is none): the tests the draw
    chosen on the device makes, on the same values (padded rows are greedy, so the unpadded
    ones decide)."""
    host = metadata.__dict__.get(_HOST_SAMPLING)
    if host is None:
        return None
    top_ks, top_ps, min_ps, all_greedy = host
    if all_greedy:
        return "greedy"
    filtering = (top_ks != 1) & ((top_ks < vocab) | (top_ps < 1.0) | (min_ps > 0.0))
    return "filter" if filtering.any() else "sample"


def _metadata_knowing_its_draw(build):
    """``SamplingMetadata.from_model_worker_batch`` wrapper: the metadata keeps its batch's
    sampling parameters as they were on the host (before they went to the device)."""

    @functools.wraps(build)
    def from_model_worker_batch(cls, batch, *args, **kwargs):
        metadata = build(cls, batch, *args, **kwargs)
        info = batch.sampling_info
        metadata.__dict__[_HOST_SAMPLING] = (info.top_ks, info.top_ps, info.min_ps, bool(info.is_all_greedy))
        return metadata

    return classmethod(from_model_worker_batch)


def _no_penalties_to_precompile(self, future_token_ids_map=None) -> None:
    """``ModelWorker.precompile_penalties`` replacement: no sampler applies penalties
    (:func:`_sample`), so the programs 0.0.2 compiles for them (a sampler per draw and batch size,
    keyed by a made-up batch that has them) would never run."""


def _precompiling_every_draw(run_precompile):
    """``ModelWorker.run_precompile`` wrapper: its forwards compile every draw's program for
    their batch sizes, not just the one their made-up batch needs, so that nothing compiles
    later whichever sampling parameters a batch brings."""

    @functools.wraps(run_precompile)
    def run_precompile_every_draw(self, *args, **kwargs):
        self.model_runner.__dict__[_PRECOMPILING] = True
        try:
            return run_precompile(self, *args, **kwargs)
        finally:
            self.model_runner.__dict__[_PRECOMPILING] = False

    return run_precompile_every_draw


def _sample_keeping_logprobs(self, logits_output, sampling_metadata, positions):
    """``ModelRunner.sample`` replacement: the token ids, as the scheduler expects.

    The batch's draw is read on the host (:func:`draw_kind`) and runs as a program of its own.
    When the scheduler asked for this batch's log-probs, both arrays come to the host in one
    transfer (the scheduler's own device_get of the ids then has nothing left to wait for).
    """
    draw = draw_kind(sampling_metadata, logits_output.next_token_logits.shape[-1])
    sample = functools.partial(_jitted_draw, *self.jitted_sampler.args, logits_output, sampling_metadata, positions)
    if draw is not None and self.__dict__.get(_PRECOMPILING):
        for other in _DRAWS.keys() - {draw}:
            sample(draw=other)
    ids, logprobs, kept = sample(draw=draw)
    if logprobs_requested(self):
        ids, token_logprobs = jax.device_get((ids, (logprobs, kept)))
        leave_token_logprobs(self, token_logprobs)
    return ids


def logprobs_requested(runner) -> bool:
    """Whether the run_batch wrapper below asked for the log-probs of the step ``runner`` runs."""
    return bool(runner.__dict__.get(_FETCH_LOGPROBS))


def leave_token_logprobs(runner, token_logprobs) -> None:
    """Leave a step's (log-probs, kept counts) on ``runner`` for the run_batch wrapper below."""
    runner.__dict__[_TOKEN_LOGPROBS] = token_logprobs


def left_token_logprobs(runner):
    """What :func:`leave_token_logprobs` left on ``runner`` for this step (None if nothing)."""
    return runner.__dict__.get(_TOKEN_LOGPROBS)


def deliver_token_logprobs(scheduler, logprobs, kept) -> None:
    """Hand a step's log-probs and kept counts (host arrays, one per row) to the run_batch
    wrapper below, where it asked for them (a decode chunk's steps, multistep.py)."""
    runner = scheduler.tp_worker.worker.model_runner
    if logprobs_requested(runner):
        leave_token_logprobs(runner, (logprobs, kept))


def _run_batch_collecting_logprobs(original):
    def run_batch(self, batch):
        sinks = self.__dict__.get(LOGPROB_SINKS) or {}
        rows = [sinks.get(req.rid) for req in batch.reqs]
        runner = self.tp_worker.worker.model_runner
        runner.__dict__[_FETCH_LOGPROBS] = any(sink is not None for sink in rows)
        try:
            result = original(self, batch)
        finally:
            fetched = runner.__dict__[_FETCH_LOGPROBS]
            runner.__dict__[_FETCH_LOGPROBS] = False
        if fetched:
            logprobs, kept = runner.__dict__.pop(_TOKEN_LOGPROBS)
            extend = batch.forward_mode.is_extend()
            for i, (req, sink) in enumerate(zip(batch.reqs, rows)):
                # process_batch_result (no overlap scheduler) appends an output token to every
                # row but retracted ones and, in a prefill, chunks before the last. Appending
                # here, before it streams a finished request out, keeps the two aligned.
                if sink is None or req.is_retracted or (extend and req.is_chunked > 0):
                    continue
                sink.append(float(logprobs[i]), int(kept[i]))
        return result

    return run_batch


def _patch_sampler() -> None:
    from sgl_jax.srt.layers import sampler
    from sgl_jax.srt.managers import scheduler, tp_worker
    from sgl_jax.srt.model_executor import model_runner
    from sgl_jax.srt.sampling.sampling_batch_info import SamplingMetadata

    if workaround_enabled("sampler"):
        sampler.Sampler.__call__ = _sample_with_logprobs
        model_runner.ModelRunner.sample = _sample_keeping_logprobs
        for name in ("from_model_worker_batch", "from_model_worker_batch_for_precompile"):
            build = SamplingMetadata.__dict__[name].__func__
            setattr(SamplingMetadata, name, _metadata_knowing_its_draw(build))
        tp_worker.ModelWorker.run_precompile = _precompiling_every_draw(tp_worker.ModelWorker.run_precompile)
        tp_worker.ModelWorker.precompile_penalties = _no_penalties_to_precompile
        scheduler.Scheduler.run_batch = _run_batch_collecting_logprobs(scheduler.Scheduler.run_batch)


def _float32_logits(self, hidden_states, lm_head):
    """``LogitsProcessor._get_logits`` replacement: logits [N, vocab] in float32."""
    hidden_states, table = lm_head.promote_dtype((hidden_states, lm_head.embedding.value), dtype=lm_head.dtype)
    return table_logits(hidden_states, table)[..., : self.vocab_size]


def _patch_logits() -> None:
    from sgl_jax.srt.layers import logits_processor

    if workaround_enabled("bf16-logits"):
        logits_processor.LogitsProcessor._get_logits = _float32_logits


def _patch_start_up(engine_module) -> None:
    from sgl_jax.srt.managers import detokenizer_manager, scheduler, tokenizer_manager
    from sgl_jax.srt.model_executor import model_runner

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
    if workaround_enabled("engine-devices"):
        scheduler.create_device_mesh = _engine_mesh(scheduler.create_device_mesh)
    if workaround_enabled("device-memory-scope"):
        model_runner.get_available_device_memory = _engine_device_memory(model_runner.get_available_device_memory)
    if workaround_enabled("failed-start-sockets"):
        for module in (engine_module, scheduler, tokenizer_manager, detokenizer_manager):
            module.get_zmq_socket = _recorded_socket(module.get_zmq_socket)


def _recorded_socket(get_zmq_socket):
    def recorded_zmq_socket(*args, **kwargs):
        sock = get_zmq_socket(*args, **kwargs)
        start_up = current_start_up()
        if start_up is not None:
            start_up.sockets.append(sock)
        return sock

    return recorded_zmq_socket


def _engine_mesh(create_device_mesh):
    from sgl_jax.srt.utils.mesh_utils import mesh_axes

    def engine_mesh(ici_parallelism, dcn_parallelism, *args, **kwargs):
        start_up = current_start_up()
        if start_up is None or start_up.devices is None:
            return create_device_mesh(ici_parallelism, dcn_parallelism, *args, **kwargs)
        devices = np.empty(len(start_up.devices), dtype=object)
        devices[:] = start_up.devices
        # (data, tensor, expert) = (1, tp_size, 1), in the order the caller gave.
        return jax.sharding.Mesh(devices.reshape(1, -1, 1), tuple(mesh_axes))

    return engine_mesh


def _engine_device_memory(get_available_device_memory):
    def engine_device_memory(device, distributed=False, empty_cache=True):
        start_up = current_start_up()
        # The engine's own reading where it is not per device (host RAM) or spans hosts.
        if device == "cpu" or jax.process_count() > 1:
            return get_available_device_memory(device, distributed=distributed, empty_cache=False)
        if start_up is not None and start_up.devices is not None:
            devices = start_up.devices
        else:
            platform = "gpu" if device in ("gpu", "cuda") else device
            devices = [d for d in jax.local_devices() if d.platform == platform]
        if not devices:
            raise RuntimeError(f"no local {device} devices for the sglang-jax engine")
        free = []
        for d in devices:
            stats = d.memory_stats()
            free.append(stats["bytes_limit"] - stats["bytes_in_use"])
        return min(free)

    return engine_device_memory


@contextlib.contextmanager
def variables_sharded_lazily():
    """Workaround "flax-eager-sharding": no eager sharding while the engine creates its model.

    Process-wide while it lasts (flax's config is global): engine start-up is not thread-safe in
    other respects either.
    """
    import flax

    if not workaround_enabled("flax-eager-sharding"):
        yield
        return
    with flax.config.temp_flip_flag("always_shard_variable", False):
        yield


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
    if not workaround_enabled("native-attention-memory"):
        return
    from sgl_jax.srt.layers.attention import native_backend
    from sgl_jax.srt.layers.radix_attention import AttentionType
    from sgl_jax.srt.mem_cache.memory_pool import merge_kv
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode

    engine_call = native_backend.NativeAttention.__call__

    def paged_call(self, q, k, v, layer, forward_batch, token_to_kv_pool):
        if _native_attention_baseline:
            return engine_call(self, q, k, v, layer, forward_batch, token_to_kv_pool)
        # The engine's KV write (workaround kv-pool-conversions: through an integer view); the
        # fused layer it returns is what the caller persists.
        pool = token_to_kv_pool.kv_buffer[layer.layer_id - token_to_kv_pool.start_layer]
        platform = mesh_platform(token_to_kv_pool.mesh)
        integer_view = (
            workaround_enabled("kv-pool-conversions") and pool.dtype.itemsize == 2 and converts_16bit_rows(platform)
        )
        if integer_view:
            loc = forward_batch.out_cache_loc
            kv_fused = set_rows(pool, jnp.where(loc >= 0, loc, pool.shape[0]), merge_kv(k, v), True)
        else:
            _, _, kv_fused = self._get_and_update_kv_cache(k, v, forward_batch, token_to_kv_pool, layer.layer_id)
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
            integer_view=integer_view,
            head_major=runs_head_major_dots(platform, pool.dtype.name),
            kv_walk=None if extend else traced_kv_walk(),
        )
        return output, kv_fused

    native_backend.NativeAttention.__call__ = paged_call


def _initialize_keeping_16_bit_precision(initialize):
    """``ModelRunner.initialize`` wrapper: for 16-bit weights, the matmul precision it set
    ('highest' on GPU) is put back to what it was before, ahead of the precompile and of the
    value the scheduler thread takes (workaround ``bf16-matmul-precision``)."""

    @functools.wraps(initialize)
    def initialize_keeping_precision(self):
        before = jax_config.default_matmul_precision.get_global()
        initialize(self)
        if jnp.dtype(self.dtype).itemsize == 2 and jax_config.default_matmul_precision.get_global() != before:
            jax.config.update("jax_default_matmul_precision", before)

    return initialize_keeping_precision


def _jit_forward_under_engine_options(initialize_jit):
    """``ModelRunner.initialize_jit`` wrapper: the forward it jits is jitted again with 0.0.2's
    own arguments (model_runner.py) under the engine's XLA compile options (workaround
    ``gpu-dot-merger``). The wrapper the engine calls reads the jit from its closure cell."""

    @functools.wraps(initialize_jit)
    def initialize_jit_under_options(self):
        initialize_jit(self)
        cell = forward_cells(self)["jitted_run_model"]
        cell.cell_contents = jit_with_options(
            cell.cell_contents.__wrapped__,
            engine_compiler_options(mesh_platform(self.mesh)),
            donate_argnames=["token_to_kv_pool"],
            static_argnames=["model_state_def"],
        )

    return initialize_jit_under_options


def _patch_model_precision() -> None:
    from sgl_jax.srt.model_executor import model_runner

    if workaround_enabled("bf16-matmul-precision"):
        model_runner.ModelRunner.initialize = _initialize_keeping_16_bit_precision(model_runner.ModelRunner.initialize)


def _patch_head_dtype() -> None:
    from sgl_jax.srt.model_executor import model_runner

    if not workaround_enabled("untied-head-dtype"):
        return
    load_model = model_runner.ModelRunner.load_model

    def load_model_with_the_head_in_the_model_dtype(self):
        load_model(self)
        # Before the forward is jitted (and precompiled) over the model's graph and state.
        head = getattr(self.model, "lm_head", None)
        if head is not None and jnp.dtype(head.dtype) != jnp.dtype(self.dtype):
            weight = head.embedding.value
            head.dtype = head.param_dtype = self.dtype
            head.embedding.value = jax.device_put(weight.astype(self.dtype), weight.sharding)

    model_runner.ModelRunner.load_model = load_model_with_the_head_in_the_model_dtype


def eos_id_set(value) -> set[int]:
    """A config's ``eos_token_id`` (an int, a list of them, or None) as a set."""
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def _patch_eos_token_ids() -> None:
    from sgl_jax.srt.configs.model_config import ModelConfig

    if workaround_enabled("eos-token-id-zero"):

        def get_hf_eos_token_id(self) -> set[int]:
            return eos_id_set(getattr(self.hf_config, "eos_token_id", None)) | eos_id_set(
                getattr(self.hf_generation_config, "eos_token_id", None) if self.hf_generation_config else None
            )

        ModelConfig.get_hf_eos_token_id = get_hf_eos_token_id


def _patch_forward_compile_options() -> None:
    from sgl_jax.srt.model_executor import model_runner

    if workaround_enabled("gpu-dot-merger"):
        model_runner.ModelRunner.initialize_jit = _jit_forward_under_engine_options(
            model_runner.ModelRunner.initialize_jit
        )


def _patch_model_loading() -> None:
    from sgl_jax.srt.layers import embeddings
    from sgl_jax.srt.utils import weight_utils

    if workaround_enabled("llama3-rope-scaling"):
        init_rope = embeddings.Llama3RotaryEmbedding.__init__

        def init_with_scaled_frequencies(self, *args, **kwargs):
            init_rope(self, *args, **kwargs)
            # The engine's own scaled frequencies; built while the model is traced, from constants.
            with jax.ensure_compile_time_eval():
                self._inv_freq_np = np.asarray(self._compute_inv_freq(self.base), dtype=np.float32)

        embeddings.Llama3RotaryEmbedding.__init__ = init_with_scaled_frequencies
    if workaround_enabled("head-dim-padding"):
        init_loader = weight_utils.WeightLoader.__init__

        def init_without_head_dim_padding(self, *args, **kwargs):
            init_loader(self, *args, **kwargs)
            self.head_dim, self.head_dim_pad = self.head_dim_original, 0

        weight_utils.WeightLoader.__init__ = init_without_head_dim_padding


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
    matmul_precision = jax_config.default_matmul_precision.get_global()
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
        jax.config.update("jax_default_matmul_precision", matmul_precision)
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
