"""Shared test helpers: of tests/ and tests/unit/ (the unit layer, which boots no engine)."""

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from models import TinyModelSpec, TinyMoeSpec, flax_model_for, tiny_llama3_spec, tiny_random_llama_spec
from rollout import WorkerConfig, in_place_updates
from rollout.engine import EngineOptions, workarounds
from rollout.engine.attention import paged_attention

REPO = Path(__file__).resolve().parents[1]


def one_padding_bucket_each(settings: dict) -> None:
    """One padding size for a forward's batch rows and one for its prefill tokens, where
    ``settings`` names none: the engine pads every forward up to the smallest of its sizes that
    fits and always adds its largest, so each smaller size is one more program to compile (a few
    seconds each on these CPUs), while a tiny model's padded rows cost next to nothing."""
    chunk = settings.get("chunked_prefill_size")
    tokens = min(settings["max_prefill_tokens"], chunk) if chunk and chunk > 0 else settings["max_prefill_tokens"]
    settings.setdefault("precompile_bs_paddings", (settings["max_running_requests"],))
    settings.setdefault("precompile_token_paddings", (tokens,))


def tiny_worker_config(model_dir, **overrides) -> WorkerConfig:
    """Small engine limits that start fast on a 2-core CPU, on the first dp_size x tp_size
    of the 4 fake devices unless ``devices`` is given."""
    settings = dict(
        model_path=str(model_dir),
        dtype="float32",
        max_total_tokens=2048,
        context_length=256,
        max_running_requests=16,
        max_prefill_tokens=512,
        chunked_prefill_size=512,
    )
    settings.update(overrides)
    one_padding_bucket_each(settings)
    if "devices" not in settings:
        settings["devices"] = tuple(jax.devices()[: settings.get("dp_size", 1) * settings.get("tp_size", 1)])
    return WorkerConfig(**settings)


@contextlib.contextmanager
def serve_process(model_dir, *flags, env=None):
    """``python -m rollout.serve`` on a tiny model in a subprocess: yields (process, url) once it
    serves; killed at exit if still running."""
    command = [
        sys.executable,
        "-m",
        "rollout.serve",
        "--model-path",
        str(model_dir),
        "--port",
        "0",
        "--dtype",
        "float32",
        "--max-total-tokens",
        "1024",
        "--context-length",
        "256",
        "--max-running-requests",
        "4",
        # One row size (one_padding_bucket_each); prefills take 512 or the engine's largest, its
        # chunked prefill of 2048 tokens, where its defaults would compile six sizes.
        "--precompile-bs-paddings",
        "4",
        "--precompile-token-paddings",
        "512",
        *flags,
    ]
    env = {**os.environ, "XLA_FLAGS": "", **(env or {})}
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            assert line, "the server exited before serving"
            match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            url = match.group(1) if match else None
        assert url is not None, "the server did not start serving within 180 s"
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# ---- paged attention inputs (tests/test_attention.py, tests/unit/test_attention_kernels.py) ----

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def ragged_batch(rng, prefix_lens, extend_lens, page_size=1, pool_slots=256, loc_len=96, pad_tokens=5):
    """A batch laid out the way the scheduler lays it out, with padded requests and tokens."""
    prefix_lens = np.asarray(prefix_lens, np.int32)
    extend_lens = np.asarray(extend_lens, np.int32)
    seq_lens = prefix_lens + extend_lens
    kv = rng.standard_normal((pool_slots, 2 * KV_HEADS, HEAD_DIM)).astype(np.float32)
    # Slot 0 is the padding slot; real tokens sit anywhere else in the pool, in no order.
    slots = iter(rng.permutation(np.arange(1, pool_slots)))
    cache_loc = np.zeros(loc_len, np.int32)
    offset = 0
    for n in seq_lens:
        cache_loc[offset : offset + n] = [next(slots) for _ in range(n)]
        offset += -(-n // page_size) * page_size
    q = rng.standard_normal((int(extend_lens.sum()) + pad_tokens, HEADS, HEAD_DIM)).astype(np.float32)
    return q, kv, cache_loc, seq_lens, prefix_lens, extend_lens


def attend(q, kv, cache_loc, seq_lens, prefix_lens=None, extend_lens=None, **kwargs):
    as_jax = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    fn = jax.jit(lambda *args: paged_attention(*args, num_heads=HEADS, num_kv_heads=KV_HEADS, **kwargs))
    return np.asarray(fn(*map(as_jax, (q, kv, cache_loc, seq_lens, prefix_lens, extend_lens))))


# ---- checkpoints ---------------------------------------------------------------------------------


def orbax_save(path, tree):
    """``tree`` as an orbax checkpoint at ``path`` (returned)."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    return path


# ---- engine workarounds (tests/test_engine_workarounds.py, tests/unit/test_workarounds.py) -------


def child_env(disabled: str = "", **variables) -> dict[str, str]:
    """This process's environment for a child process with the workarounds ``disabled`` (comma
    separated) switched off. Without ``xla-stale-packed-weights`` the child also runs without the
    flag this process's import of rollout added to XLA_FLAGS, which it would inherit."""
    env = dict(os.environ, **variables)
    env[workarounds.DISABLE_ENV] = disabled
    if in_place_updates.WORKAROUND in disabled.split(","):
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(in_place_updates.XNNPACK_OFF, "").strip()
    return env


@functools.cache
def cpu_reads_stale_weights_without_the_flag() -> bool:
    """The stale-weights probe in a fresh process without its workaround: whether this machine's
    XLA:CPU reads a weight rewritten in place as its old values. It depends on the jaxlib and on
    the CPU: seen at jaxlib 0.8.0/0.8.1 on an AVX2-only AMD EPYC, not at 0.8.0 on an Intel Xeon
    with AVX-512 and AMX."""
    script = "from rollout.in_place_updates import reads_stale_weights; print('STALE', reads_stale_weights('cpu'))"
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=child_env(in_place_updates.WORKAROUND, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return "STALE True" in result.stdout.splitlines()


# The test that fails without each workaround (run with ROLLOUT_DISABLE_WORKAROUNDS=<name>, one process
# each, by tests/test_engine_workarounds.py). A new entry of WORKAROUNDS needs one here
# (tests/unit/test_workarounds.py checks).
PINNING_TESTS = {
    "duplicate-pytree-registration": "tests/unit/test_patches.py::test_duplicate_pytree_registration_import",
    "sampler": "tests/test_sampling_filters.py::test_temperature_sampling_follows_the_softmax",
    "process-kill-on-error": (
        "tests/test_engine_workarounds.py::test_engine_thread_error_is_an_exception_not_a_dead_process"
    ),
    "idle-busy-spin": "tests/test_generate.py::test_worker_idles_quietly",
    "whole-batch-admission": (
        "tests/test_generate.py::test_a_calls_requests_share_one_prefill_however_slowly_they_are_sent"
    ),
    "process-global-side-effects": "tests/test_engine_workarounds.py::test_process_global_state_is_preserved",
    "untied-head-dtype": "tests/test_engine_workarounds.py::test_untied_head_computes_in_the_model_dtype",
    "detokenizer-output-ids": "tests/test_generate.py::test_eos_stop_keeps_the_eos_token",
    "shared-hf-config": "tests/test_engine_workarounds.py::test_second_tensor_parallel_engine_on_the_same_model",
    "one-request-per-sample": "tests/test_generate.py::test_n_samples_per_prompt_are_independent_and_prompt_major",
    "flush-cache": "tests/test_engine_workarounds.py::test_flush_prefix_cache_drops_kv_of_the_old_weights",
    "engine-devices": "tests/test_multi_engine.py::test_pair_keeps_every_array_on_its_devices",
    "device-memory-scope": (
        "tests/unit/test_patches.py::test_device_memory_is_measured_on_the_engines_devices_without_clearing_caches"
    ),
    "concurrent-start-up": "tests/unit/test_start_up.py::test_start_ups_take_turns",
    "gpu-matmul-precision": (
        "tests/test_multi_engine.py::test_close_joins_every_thread_and_gpu_precision_stays_in_the_engine"
    ),
    "bf16-matmul-precision": (
        "tests/test_multi_engine.py::test_a_bf16_engine_precompiles_and_runs_under_the_default_matmul_precision"
    ),
    "gpu-dot-merger": (
        "tests/unit/test_patches.py::test_the_engines_forward_is_jitted_again_under_the_engine_compile_options"
    ),
    "failed-start-sockets": "tests/test_multi_engine.py::test_a_failed_start_up_lets_the_process_exit",
    "native-attention-memory": "tests/test_attention.py::test_engine_forward_memory_does_not_follow_padding_limits",
    "kv-pool-conversions": "tests/test_attention.py::test_bf16_kv_pool_is_not_converted_per_forward",
    "bf16-logits": "tests/unit/test_patches.py::test_bfloat16_engine_logits_are_float32",
    "flax-eager-sharding": (
        "tests/test_engine_workarounds.py::test_flax_eager_sharding_is_off_only_while_the_engine_builds"
    ),
    "failure-signal-handler": "tests/test_faults.py::test_the_engines_forwards_leave_the_sigterm_handler_alone",
    "llama3-rope-scaling": "tests/test_families.py::test_llama3_rope_scaling_gives_the_trainers_positions",
    "head-dim-padding": "tests/test_families.py::test_head_dim_64_boots_from_safetensors_and_generates_the_flax_tokens",
    "moe-forward": "tests/test_qwen3_moe.py::test_engine_serves_the_flax_models_tokens_from_safetensors",
    "moe-jax-import": "tests/unit/test_engine_moe.py::test_the_engine_knows_qwen3_moe",
    "moe-expert-shapes": "tests/test_qwen3_moe.py::test_tensor_parallel_dummy_engine_holds_every_expert",
    "moe-sparse-step": "tests/test_qwen3_moe.py::test_decoder_sparse_step_and_unnormalized_routing",
    "tpu-kernel-jax-names": (
        "tests/unit/test_tpu_kernels.py::"
        "test_the_engines_kv_write_kernel_in_tpu_interpret_mode_writes_what_a_scatter_writes"
    ),
    "retracted-admission": (
        "tests/unit/test_scheduling.py::test_a_retracted_request_is_admitted_for_the_tokens_it_has_left"
    ),
    "stop-ids-with-ignore-eos": "tests/test_generate.py::test_stop_token_ids_end_a_completion_under_ignore_eos",
    "abandoned-row-tasks": "tests/unit/test_request_loop.py::test_a_rows_task_left_behind_by_a_stream_logs_nothing",
    "retracted-cached-tokens": "tests/test_generate.py::test_calls_retracted_in_a_tight_kv_pool_all_return",
    "stop-token-at-length": "tests/test_generate.py::test_a_stop_token_sampled_last_ends_as_stop",
    "aborted-queued-state": (
        "tests/test_faults.py::test_a_call_cancelled_while_its_rows_wait_in_the_queue_leaves_no_request_state"
    ),
    "eos-token-id-zero": "tests/unit/test_patches.py::test_eos_ids_are_a_set_whatever_their_value",
    "xla-stale-packed-weights": (
        "tests/test_in_place_updates.py::test_the_engine_serves_the_trainers_params_after_donated_updates[qwen2-tp1]"
    ),
}
# Workarounds that are part of how an engine runs here and cannot be switched off on their own;
# their pinning tests check the behaviour directly.
NOT_SWITCHABLE = {
    "concurrent-start-up": "the start-up lock also tells each engine's threads which engine they serve",
    "gpu-matmul-precision": "GPU only; its test simulates the engine's GPU branch on CPU",
    "moe-jax-import": "only jax >= 0.12 needs it; it is always on",
    "tpu-kernel-jax-names": "only jax >= 0.12 needs it; it is always on",
}


# ---- engines ---------------------------------------------------------------------------------------


def tiny_options(model_dir, devices=None, tp_size=None, **overrides) -> EngineOptions:
    settings = dict(
        model_path=str(model_dir),
        dtype="float32",
        tp_size=tp_size or (len(devices) if devices else 1),
        max_total_tokens=1024,
        context_length=256,
        max_running_requests=16,
        max_prefill_tokens=512,
        chunked_prefill_size=512,
        devices=devices,
    )
    settings.update(overrides)
    one_padding_bucket_each(settings)
    return EngineOptions(**settings)


# ---- model families (tests/test_families.py, tests/unit/test_registry.py) --------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    family: str
    spec: Callable[[], TinyModelSpec]
    tp_size: int
    # The end of the JAX range whose `make test` runs this case (its marker: oldest_end or newest_end).
    end: str


# The contract cases of tests/test_families.py. Every family in models.FAMILIES needs at least one
# (tests/unit/test_registry.py checks). Each case runs at one end of the JAX range: Llama's cases
# split between the two, and the other families' engines run at both ends elsewhere (Qwen2/Qwen3
# parity at both tp sizes, tied and untied: tests/test_sync.py and test_logprobs.py; Qwen3-MoE:
# tests/test_qwen3_moe.py).
CASES = [
    Case("qwen2-tied-gqa-tp2", "qwen2", lambda: TinyModelSpec(seed=11), 2, "oldest"),
    Case(
        "qwen3-tied-tp1",
        "qwen3",
        lambda: TinyModelSpec(architecture="qwen3", num_key_value_heads=2, seed=12),
        1,
        "newest",
    ),
    Case("llama3-untied-gqa-hd64-tp2", "llama", lambda: tiny_llama3_spec(seed=13), 2, "newest"),
    Case("llama3-tied-hd64-tp1", "llama", lambda: tiny_llama3_spec(tie_word_embeddings=True, seed=14), 1, "oldest"),
    Case("tiny-random-llama-hd4-tp2", "llama", lambda: tiny_random_llama_spec(seed=15), 2, "oldest"),
    # 8 experts (top-2) sharded over 2 devices, layer 0 dense; tp 1 in tests/test_qwen3_moe.py.
    Case("qwen3-moe-tp2", "qwen3_moe", lambda: TinyMoeSpec(seed=16), 2, "newest"),
]


def flax_model(model_dir):
    """The Flax trainer model of a model dir's config.json."""
    return flax_model_for(json.loads((Path(model_dir) / "config.json").read_text()))


# ---- RL examples -----------------------------------------------------------------------------------

GSM8K_SAMPLE = REPO / "tests" / "data" / "gsm8k_sample.jsonl"  # GSM8K-format rows, written for these tests


# ---- the guide's code blocks (tests/test_readme.py, tests/unit/test_readme.py) ---------------------

README = REPO / "README.md"
DOCS = REPO / "docs"
BLOCK = re.compile(r"<!-- readme-block: (?P<id>[\w-]+) -->\n```(?P<language>\w+)\n(?P<code>.*?)^```", re.S | re.M)


class Block(NamedTuple):
    path: Path
    language: str
    code: str


def guide_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def readme_blocks() -> dict[str, Block]:
    """Every marked block of the README and docs/, by ID."""
    blocks: dict[str, Block] = {}
    for path in guide_files():
        for m in BLOCK.finditer(path.read_text()):
            assert m["id"] not in blocks, f"block {m['id']!r} in both {blocks[m['id']].path.name} and {path.name}"
            blocks[m["id"]] = Block(path, m["language"], m["code"])
    return blocks


def block_code(block: str) -> str:
    return readme_blocks()[block].code


def source_name(block: str) -> str:
    return f"{readme_blocks()[block].path.relative_to(REPO)}:{block}"


def perturbed_params(params: dict, seed: int = 0) -> dict:
    """Host copies of a nested param dict with noise of half each leaf's std added: weights that
    change a tiny model's greedy tokens (what an in-flight swap lands)."""
    rng = np.random.default_rng(seed)

    def perturb(tree):
        return {k: perturb(v) if isinstance(v, dict) else _noisy(np.asarray(v), rng) for k, v in tree.items()}

    return perturb(params)


def _noisy(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return x + (0.5 * x.std() * rng.standard_normal(x.shape)).astype(x.dtype)


def wait_until(condition, timeout: float = 120.0) -> None:
    """Poll state the code under test sets (not a sleep standing in for an event)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def donated_during(call: Callable, started: Callable[[], bool], params):
    """``call()`` on a thread; once ``started()`` holds, a train step donates ``params`` as a
    trainer's would outside ``released_for_training`` (jitted, compiled first on copies).
    Returns (the step's output, what ``call`` raised: None if it returned)."""
    step = jax.jit(lambda tree: jax.tree_util.tree_map(lambda x: x * 1.0, tree), donate_argnums=0)
    step(jax.tree_util.tree_map(jnp.copy, params))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(call)
        wait_until(started)
        stepped = step(params)
        return stepped, future.exception(timeout=120)


def swap_at_token(worker, new_params, position, generate: Callable, **swap):
    """Run ``generate()`` (one request) while an in-flight sync lands exactly when the request has
    ``position`` tokens. Returns (batch, sync report)."""
    engine = worker.engine

    def reached():
        return any(n >= position for n in engine.testing.output_lengths().values())

    return swap_during(worker, new_params, reached, generate, **swap)


def swap_during(worker, new_params, reached: Callable[[], bool], generate: Callable, **swap):
    """Run ``generate()`` while an in-flight sync lands at the first forward boundary where
    ``reached()`` (scheduler thread): a boundary call holds the scheduler there until the sync
    has queued its swap, which then runs at that same boundary. Returns (batch, sync report).
    A failure anywhere lets the hold go: a hold left queued would stop the module's next call."""
    engine = worker.engine
    held, release, results, errors = threading.Event(), threading.Event(), {}, []

    def hold():
        held.set()
        release.wait()

    def run(name, fn):
        try:
            results[name] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            held.set()

    def hold_at():  # also once the hold is let go
        return release.is_set() or reached()

    threads = [threading.Thread(target=run, args=("hold", lambda: engine.call_at_boundary(hold, when=hold_at)))]
    threads.append(threading.Thread(target=run, args=("batch", generate)))
    for t in threads:
        t.start()
    try:
        assert held.wait(300) and not errors, errors
        sync = threading.Thread(
            target=run, args=("report", lambda: worker.sync_params(new_params, in_flight=True, **swap))
        )
        sync.start()
        threads.append(sync)
        while engine.testing.boundary_calls_queued == 0 and sync.is_alive():  # the swap is queued behind the hold
            time.sleep(0.001)
    finally:
        release.set()
        for t in threads:
            t.join(300)
    assert not errors, errors
    return results["batch"], results["report"]


@contextlib.contextmanager
def admitted_together(worker, requests: int, timeout: float = 300):
    """Calls made inside, from several threads or tasks, reach the engines while they wait:
    every engine of ``worker`` is held before its next batch until ``requests`` requests (rows,
    all engines together) have been sent to them. Without it a loaded host can send one call
    many forwards after another; with it a call whose requests are still in the socket when the
    hold ends joins one forward later at most. The calls must be n=1: with n > 1 a call sends
    its prompts first and waits for their prefill, which the hold would keep from running."""
    from sgl_jax.srt.managers.tokenizer_manager import TokenizerManager

    send = TokenizerManager._send_one_request
    lock, sent, all_sent = threading.Lock(), [0], threading.Event()
    holding = threading.Semaphore(0)

    def counted_send(self, *args, **kwargs):
        state = send(self, *args, **kwargs)
        with lock:
            sent[0] += 1
            if sent[0] >= requests:
                all_sent.set()
        return state

    def hold():
        holding.release()
        if not all_sent.wait(timeout):
            raise TimeoutError(f"{sent[0]} of the {requests} requests expected were sent")

    TokenizerManager._send_one_request = counted_send
    try:
        with concurrent.futures.ThreadPoolExecutor(len(worker.engines)) as pool:
            holds = [pool.submit(engine.call_at_boundary, hold) for engine in worker.engines]
            try:
                for _ in holds:  # every scheduler held before the first request is sent
                    assert holding.acquire(timeout=timeout)
                yield
            finally:
                all_sent.set()  # a body that failed before sending all must not leave them held
                held_for = [future.exception() for future in holds]
        assert sent[0] == requests, f"{sent[0]} requests sent, {requests} expected"
        assert held_for == [None] * len(holds), held_for
    finally:
        TokenizerManager._send_one_request = send


@contextlib.contextmanager
def held_mid_call(worker, until: Callable[[], bool], timeout: float = 300):
    """Holds ``worker``'s first engine at the first forward boundary where a request has sampled
    a token, until ``until()`` holds (polled there) or the block ends: a call is then still
    running, whatever the host's load, when the block checks or does what needs one running.
    Yields an event set once the engine is held."""
    engine = worker.engine
    held, leaving = threading.Event(), threading.Event()

    def sampling():
        return any(n >= 1 for n in engine.testing.output_lengths().values())

    def hold():
        held.set()
        deadline = time.monotonic() + timeout
        while not (leaving.is_set() or until()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"held for {timeout} s and the condition never held")
            time.sleep(0.001)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Also once the block ends: a block that failed before any token must not leave it queued.
        holding = pool.submit(engine.call_at_boundary, hold, when=lambda: leaving.is_set() or sampling())
        try:
            yield held
        finally:
            leaving.set()
        holding.result(timeout)
