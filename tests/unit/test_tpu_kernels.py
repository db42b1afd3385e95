"""The engine's TPU kernels (Pallas) on CPU, in Pallas' TPU interpret mode (``pytest -k
interpret``): the fused KV-cache write runs and writes what a scatter writes; the ragged paged
attention kernel (the "fa" backend) traces. Both need workaround "tpu-kernel-jax-names" at jax
0.12. What this proves and does not: docs/platforms.md."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rollout.engine import install_workarounds


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
    with pltpu.force_tpu_interpret_mode(), mesh_context(mesh):
        written = update_fused_kv_cache(
            jax.device_put(fused, heads), jnp.asarray(slots), jax.device_put(pool, heads), page_size=page_size
        )
    np.testing.assert_array_equal(np.asarray(written), expected)


def test_the_engines_attention_kernel_traces_in_tpu_interpret_mode():
    """flash_attention.ragged_paged_attention, a decode and a prefill sequence: the kernel and
    its specs trace to a pallas_call (at jax 0.12 only with "tpu-kernel-jax-names": pltpu.ANY).
    Running it stops in JAX's TPU interpreter, which cannot DMA through the reshaped page
    table the kernel reads (docs/platforms.md)."""
    from sgl_jax.srt.layers.attention.flash_attn_kernel.flash_attention import ragged_paged_attention

    heads, kv_heads, head_dim, page_size, pages, seqs, pages_per_seq = 2, 1, 128, 16, 16, 4, 4
    rng = np.random.default_rng(0)
    tokens = 8
    q = jnp.asarray(rng.normal(size=(tokens, heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(tokens, kv_heads, head_dim)), jnp.float32)
    cache = jnp.asarray(rng.normal(size=(pages, page_size, 2 * kv_heads, head_dim)), jnp.float32)
    kv_lens = jnp.asarray([20, 40, 0, 0], jnp.int32)  # a decode row, then a 7-token prefill
    page_indices = jnp.arange(seqs * pages_per_seq, dtype=jnp.int32) % pages
    cu_q_lens = jnp.asarray([0, 1, 8, 8, 8], jnp.int32)
    cu_kv_lens = jnp.asarray([0, 20, 60, 60, 60], jnp.int32)
    distribution = jnp.asarray([1, 2, 2], jnp.int32)  # 1 decode-only, 1 prefill-only sequence

    def attention(q, k, v, cache):
        return ragged_paged_attention(
            q,
            k,
            v,
            cache,
            kv_lens,
            page_indices,
            cu_q_lens,
            cu_kv_lens,
            distribution,
            sm_scale=head_dim**-0.5,
            num_kv_pages_per_block=2,
            num_queries_per_block=8,
            vmem_limit_bytes=64 << 20,
        )

    with pltpu.force_tpu_interpret_mode():
        traced = jax.make_jaxpr(attention)(q, k, k, cache)
    assert "pallas_call" in str(traced)
    outputs = traced.out_avals
    assert outputs[0].shape == q.shape  # the attention, then the updated cache
