"""The engine's TPU kernels (Pallas) on CPU, in Pallas' TPU interpret mode (``pytest -k
interpret``): the fused KV-cache write writes what a scatter writes; the ragged paged attention
kernel (the "fa" backend) computes what a numpy attention over the same pages does and writes
the new tokens' K and V. Both need workaround "tpu-kernel-jax-names" at jax 0.12. What this
proves and does not: docs/platforms.md."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rollout.engine import install_workarounds, tpu_interpret


@pytest.fixture(scope="module", autouse=True)
def engine_kernels():
    install_workarounds()


def mesh_context(mesh):
    # The engine's own choice: use_mesh where JAX has it, set_mesh after.
    use_mesh = getattr(jax.sharding, "use_mesh", None)
    return use_mesh(mesh) if use_mesh is not None else jax.set_mesh(mesh)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engines_kv_write_kernel_in_tpu_interpret_mode_writes_what_a_scatter_writes(dtype, page_size, tp):
    """Pins WORKAROUNDS "tpu-kernel-jax-names" at jax 0.12 (the kernel's TPUMemorySpace and
    bit_width): memory_pool.update_fused_kv_cache, the TPU path's KV write, with its heads split
    over ``tp`` devices as the engine shards the pool; slot -1 is padding."""
    from sgl_jax.srt.mem_cache.memory_pool import update_fused_kv_cache

    rng = np.random.default_rng(page_size)
    fused = rng.normal(size=(9, 4, 128)).astype(dtype)  # tokens, K and V of 2 KV heads, head_dim
    slots = np.array([5, 6, 7, 8, 20, 21, 22, 40, -1], np.int32)
    pool = rng.normal(size=(64, 4, 128)).astype(dtype)
    expected = pool.copy()
    expected[slots[slots >= 0]] = fused[slots >= 0]
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tensor",))
    heads = NamedSharding(mesh, P(None, "tensor", None))
    with pltpu.force_tpu_interpret_mode(tpu_interpret.interpret_params()), mesh_context(mesh):
        written = update_fused_kv_cache(
            jax.device_put(fused, heads), jnp.asarray(slots), jax.device_put(pool, heads), page_size=page_size
        )
    np.testing.assert_array_equal(np.asarray(written), expected)


def reference_attention(q, new_kv, cache, kv_lens, page_indices, cu_q_lens, cu_kv_lens, page_size):
    """(the attention, the cache with the new tokens' K and V written) of the engine's ragged
    paged attention, from its inputs' meaning: sequence ``s`` has ``kv_lens[s]`` keys, the last
    of them its new tokens (``cu_q_lens``); key ``p`` lives in page
    ``page_indices[ceil(cu_kv_lens[s] / page_size) + p // page_size]`` at ``p % page_size``, K
    and V of KV head ``h`` at fused heads ``2h`` and ``2h + 1``; query token ``j`` sees keys up
    to its own position."""
    tokens, heads, head_dim = q.shape
    kv_heads = new_kv.shape[1] // 2
    out, written = np.zeros_like(q), cache.copy()
    for s in range(len(kv_lens)):
        q_start, q_len, kv_len = cu_q_lens[s], cu_q_lens[s + 1] - cu_q_lens[s], kv_lens[s]
        if kv_len == 0:
            continue
        first_page = -(-cu_kv_lens[s] // page_size)
        keys = np.zeros((kv_len, 2 * kv_heads, head_dim), q.dtype)
        for p in range(kv_len):
            page, offset = page_indices[first_page + p // page_size], p % page_size
            if p >= kv_len - q_len:  # a new token's K and V, written to its slot
                written[page, offset] = new_kv[q_start + p - (kv_len - q_len)]
            keys[p] = written[page, offset]
        for j in range(q_len):
            seen = keys[: kv_len - q_len + j + 1]
            for h in range(heads):
                kv = h // (heads // kv_heads)
                scores = seen[:, 2 * kv] @ q[q_start + j, h] / np.sqrt(head_dim)
                weights = np.exp(scores - scores.max())
                out[q_start + j, h] = weights / weights.sum() @ seen[:, 2 * kv + 1]
    return out, written


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("pages_in_order", [True, False], ids=["pages-in-order", "pages-shuffled"])
def test_the_engines_attention_kernel_in_tpu_interpret_mode_computes_attention(kv_heads, pages_in_order):
    """flash_attention.ragged_paged_attention (the "fa" backend), in float32: a decode row,
    a 7-token prefill after 33 cached keys and an empty sequence give the attention and the
    written cache a numpy reference gives (at jax 0.12 only with "tpu-kernel-jax-names").
    JAX's TPU interpreter cannot read through the reshaped and bitcast refs the kernel DMAs
    and loads through; rollout/engine/tpu_interpret.py teaches it (the kernel's semantics are the
    interpreter's; docs/platforms.md says what this proves)."""
    from sgl_jax.srt.layers.attention.flash_attn_kernel.flash_attention import ragged_paged_attention

    from rollout.engine.tpu_interpret import interpreting_reshaped_refs

    heads, head_dim, page_size, pages = 4, 128, 16, 16
    rng = np.random.default_rng(kv_heads)
    tokens = 8
    q = rng.normal(size=(tokens, heads, head_dim)).astype(np.float32)
    k, v = (rng.normal(size=(tokens, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    cache = rng.normal(size=(pages, page_size, 2 * kv_heads, head_dim)).astype(np.float32)
    kv_lens = np.array([20, 40, 0, 0], np.int32)  # a decode row, then 33 cached keys and 7 new
    page_indices = np.arange(pages, dtype=np.int32) if pages_in_order else rng.permutation(pages).astype(np.int32)
    cu_q_lens = np.array([0, 1, 8, 8, 8], np.int32)
    cu_kv_lens = np.array([0, 20, 60, 60, 60], np.int32)
    distribution = np.array([1, 2, 2], np.int32)  # 1 decode-only, 1 prefill-only sequence
    new_kv = np.stack([k, v], axis=2).reshape(tokens, 2 * kv_heads, head_dim)  # k0, v0, k1, v1
    expected, written = reference_attention(q, new_kv, cache, kv_lens, page_indices, cu_q_lens, cu_kv_lens, page_size)
    with pltpu.force_tpu_interpret_mode(tpu_interpret.interpret_params()), interpreting_reshaped_refs():
        out, updated = ragged_paged_attention(
            *map(jnp.asarray, (q, k, v, cache, kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution)),
            sm_scale=head_dim**-0.5,
            num_kv_pages_per_block=2,
            num_queries_per_block=8,
            vmem_limit_bytes=64 << 20,
        )
        out, updated = jax.block_until_ready((out, updated))
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(updated).reshape(written.shape), written)


class _FieldBuffer:
    """A buffer as jax 0.8.0 to 0.10.0 keep one: its array in a field."""

    def __init__(self, content):
        self.content = content


class _PropertyBuffer:
    """A buffer as jax 0.10.1 on keep one: ``_content`` and ``_logical_shape``, ``content`` a
    read-only property."""

    def __init__(self, content):
        self._content, self._logical_shape = content, content.shape

    @property
    def content(self):
        return self._content


def _layout(release: str):
    """An importer of the interpreter's modules, laid out as ``release`` lays them out."""

    def to_range(*_):
        return release

    def get_shared_memory():
        return release

    calls, memory, utils = types.SimpleNamespace(), types.SimpleNamespace(), types.SimpleNamespace()
    if release == "0.8.0":
        memory.get_shared_memory, memory._to_range = get_shared_memory, to_range
    else:
        calls._get_shared_memory = get_shared_memory
        if release == "0.8.1":
            calls._to_range = to_range
        else:
            utils.to_range = to_range
    modules = {"interpret_pallas_call": calls, "shared_memory": memory, "utils": utils}
    return lambda name: modules[name.rsplit(".", 1)[1]], calls, memory


@pytest.mark.parametrize("release", ["0.8.0", "0.8.1", "0.8.2", "0.12.0"])
def test_tpu_interpret_finds_the_interpreters_internals_where_each_release_keeps_them(release):
    """The interpreter's internals moved between the supported releases (0.8.1 and 0.8.2 moved
    the accesses and the index function, 0.10.1 a buffer's array); CI runs 0.8.0 and the newest
    only, so the lookups of each layout are checked here on stand-ins."""
    import_module, calls, memory = _layout(release)
    module, shared_memory, to_range = tpu_interpret._interpreter(import_module)
    assert module is (memory if release == "0.8.0" else calls)
    assert shared_memory() == to_range() == release


@pytest.mark.parametrize("buffer_type", [_FieldBuffer, _PropertyBuffer], ids=["field", "property"])
def test_tpu_interpret_swaps_a_buffers_array_for_one_access_and_back(buffer_type):
    whole = np.arange(12.0)
    buffer = buffer_type(whole)
    restore = tpu_interpret._set_buffer(buffer, whole.reshape(3, 4))
    assert buffer.content.shape == (3, 4) and np.shares_memory(buffer.content, whole)
    if buffer_type is _PropertyBuffer:
        assert buffer._logical_shape == (3, 4)
    restore()
    assert buffer.content is whole and getattr(buffer, "_logical_shape", (12,)) == (12,)
