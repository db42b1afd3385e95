"""sync_params of a Qwen3-MoE tree placed by ``param_shardings()``, on a small MoE shape.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
        python -m bench.moe_sync_bench [--layers 2] [--experts 16] [--tp 2] [--dtype bfloat16]

The shape is Qwen3-30B-A3B's per layer (hidden 2048, 32 heads, 4 KV heads, head_dim 128, experts
of moe_intermediate 768, top-8) with fewer experts and layers and a vocab of 32000 (``--vocab
151936`` for Qwen3's), to fit a shared CPU machine. Measured in one run: (a) the sync of a
trainer tree placed by ``param_shardings()`` (bytes moved, leaves aliased and those copied, with
why), (b) the same tree held whole on one device instead (every leaf resharded: the baseline),
(c) one memory pass over the tree's bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import gib, median_seconds
from models import TinyMoeSpec, flax_model_for
from rollout import RolloutWorker, WorkerConfig
from trainer_bridge import flatten_params, unflatten_params


@dataclasses.dataclass(frozen=True)
class MoeSyncBenchConfig:
    layers: int = 2
    experts: int = 16
    tp: int = 2
    dtype: str = "bfloat16"
    # Qwen3's is 151936: the engine's dummy start-up alone then peaks at 5.8 GiB of RSS here.
    vocab: int = 32000
    repeats: int = 5


def moe_spec(config: MoeSyncBenchConfig) -> TinyMoeSpec:
    return TinyMoeSpec(
        vocab_size=config.vocab,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=config.layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=config.experts,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        mlp_only_layers=(),
        max_position_embeddings=4096,
    )


def patterned_tree(hf_config: dict, dtype: str, shardings) -> dict:
    """Params of the trainer's Flax model (small values in a fixed pattern: the sync does not
    look at them), made on device where ``shardings`` place them. One fused elementwise
    computation per leaf: a random generator's temporaries would multiply the peak memory."""
    model = flax_model_for(hf_config, dtype)
    shapes = flatten_params(jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 4), np.int32))["params"])
    places = flatten_params(shardings)

    def pattern(shape):
        rows = jax.lax.broadcasted_iota(jnp.int32, shape.shape, 0)
        cols = jax.lax.broadcasted_iota(jnp.int32, shape.shape, len(shape.shape) - 1)
        return ((rows * 13 + cols * 7) % 251 - 125).astype(shape.dtype) * 1e-3

    flat = {path: jax.jit(partial(pattern, shape), out_shardings=places[path])() for path, shape in shapes.items()}
    return unflatten_params(flat)


def main(config: MoeSyncBenchConfig) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        # config.json only: the engine starts with dummy weights and gets the trainer's.
        hf_config = moe_spec(config).hf_config()
        (model_dir / "config.json").write_text(json.dumps(hf_config))
        worker_config = WorkerConfig(
            model_path=str(model_dir),
            dtype=config.dtype,
            load_format="dummy",
            tp_size=config.tp,
            devices=tuple(jax.devices()[: config.tp]),
            max_total_tokens=256,
            context_length=256,
            max_running_requests=4,
            max_prefill_tokens=256,
            chunked_prefill_size=256,
        )
        with RolloutWorker(worker_config) as worker:
            tree = patterned_tree(hf_config, config.dtype, worker.param_shardings())
            flat = flatten_params(tree)
            total = sum(x.nbytes for x in flat.values())
            print(
                f"model: Qwen3-30B-A3B layer shape, {config.layers} of 48 layers, "
                f"{config.experts} of 128 experts, vocab {config.vocab}, "
                f"{len(flat)} tensors, {gib(total)} {config.dtype}, tp={config.tp}"
            )
            worker.sync_params(tree, check_finite=False)
            placed_s = median_seconds(lambda: worker.sync_params(tree, check_finite=False), config.repeats)
            placed = worker.sync_params(tree, check_finite=False)
            engine_leaves = {leaf.path: leaf for leaf in worker.leaves}
            copied = [
                (m.trainer, flat[m.trainer].dtype, engine_leaves[m.engine].dtype)
                for m in worker.mappings
                if worker.engine.weight_leaves()[engine_leaves[m.engine].index] is not flat[m.trainer]
            ]
            experts = [m.trainer for m in worker.mappings if m.engine.rsplit(".", 1)[-1] in ("wi_0", "wi_1", "wo")]
            expert_bytes = sum(flat[p].nbytes for p in experts)
            assert worker.generate([[5, 17, 42, 8]], temperature=0.0, max_new_tokens=4).size == 1

            whole = jax.device_put(tree, jax.devices()[0])
            worker.sync_params(whole, check_finite=False)
            whole_s = median_seconds(partial(worker.sync_params, whole, check_finite=False), config.repeats)
            unplaced = worker.sync_params(whole, check_finite=False)
            del whole

        src = np.ones(total, dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        memcpy_s = median_seconds(lambda: np.copyto(dst, src), config.repeats)

    print(f"{'sync':44s} {'seconds':>9s} {'bytes moved':>13s} {'aliased':>8s} {'copied':>7s}")
    for name, seconds, report in (
        ("tree placed by param_shardings()", placed_s, placed),
        ("same tree on one device (baseline)", whole_s, unplaced),
    ):
        print(
            f"{name:44s} {seconds:9.4f} {gib(report.bytes_copied):>13s} "
            f"{report.leaves_aliased:8d} {report.leaves_copied:7d}"
        )
    print(f"{'one memory pass over the tree':44s} {memcpy_s:9.4f} {gib(total):>13s}")
    print(
        f"placed sync: {whole_s / placed_s:.0f}x faster than the baseline, {placed.bytes_copied} bytes moved; "
        f"the {len(experts)} stacked expert leaves ({gib(expert_bytes)}) all aliased: "
        f"{not any(p in experts for p, _, _ in copied)}"
    )
    for path, found, expected in copied:
        print(f"  copied: {path} ({found} -> engine {expected})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(MoeSyncBenchConfig):
        parser.add_argument("--" + field.name, type=type(field.default), default=field.default)
    main(MoeSyncBenchConfig(**vars(parser.parse_args())))
