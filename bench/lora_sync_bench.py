"""LoRA served merged (the adapters merged into the kernels on device at each sync) against LoRA
served unmerged (the engine computes ``x @ W + (alpha/r) (x @ A) @ B``; a sync moves the factors).

    JAX_PLATFORMS=cpu python -m bench.lora_sync_bench [--layers 4] [--ranks 16,64] [--repeats 5]
        [--dtype float32] [--decode-repeats 3] [--prompts 16] [--n 4] [--prompt-tokens 64]
        [--new-tokens 32]

A random Qwen2.5-1.5B-shaped model (some of its layers), engines of ``--dtype`` (float32 by
default: jax 0.8 runs bfloat16 no faster on this CPU, jax 0.12 does) and a base tree of that
dtype placed by ``param_shardings()``; float32 adapters on every attention and MLP projection,
alpha = 2 x rank, sized so that the update (alpha/r) A @ B is about half the size of the kernel
(it changes the greedy tokens). Two workers of the same sizes (KV pool, running rows, prefill chunk): one merges
(``WorkerConfig()``, for the whole run), one serves unmerged
(``WorkerConfig(unmerged_lora=LoraConfig(rank, alpha))``, one per rank). Measured in one run, per
rank; each sync after a warm-up call, the median of ``--repeats`` (of at least 20 for the syncs
that take milliseconds and the pass over the adapters), with the bytes and the XLA compilations
of its ``SyncReport`` and the peak RSS above the level before its timed calls:

- the full sync of the base alone on the merging worker (every leaf aliased): the fixed cost of
  a sync;
- merged: ``sync_params(base, adapters=..., lora=...)``, which writes every adapted kernel anew
  (kernel + (alpha/r) A @ B), against one memory pass over the adapted kernels (a jitted
  ``x + 1`` of each: read once, written once) plus the fixed cost;
- unmerged, against one memory pass over the adapter bytes plus the fixed cost:
  ``sync_params(base, adapters=..., lora=...)`` (the base aliased) and ``sync_adapters(adapters)``
  with the adapters placed where the engine serves them (aliased: nothing moves), the same with
  ``check_finite`` (two sets of arrays in turn: an array the engine already serves is not read
  again), and ``sync_adapters`` of host (numpy) adapters, which the sync copies (a trainer whose
  adapters are not where the engine serves them);
- decode: ``--prompts`` x ``--prompt-tokens`` fresh prompts, ``--n`` rows each, ``--new-tokens``
  new tokens, greedy, ``ignore_eos``, after a warm-up call of the same shapes: the merging worker
  after its merged sync, the unmerged one after the unmerged sync of the same adapters, the same
  prompts, ``--decode-repeats`` pairs of calls in turn (ABBA order). New tokens/s and the median
  of the per-pair ratios unmerged / merged of the call's time (prefill included) and of its
  median decode step (``rollout.engine.profile_steps``); the tied LM head's matmul alone, timed
  after each pair: at a few layers it is most of a step on XLA CPU, so the unmerged extra is
  also given as a share of the step less the head (what it tends to with depth); the greedy
  tokens the two workers agree on, and the first 2 tokens' agreement with the unmerged worker's
  adapters zeroed (the base alone: low, so the first agreement shows the adapters applied).

The issue's targets: an adapter-only sync moves only adapter bytes and takes at most 2x one memory
pass over them plus the fixed cost of a sync; unmerged decode at most 10% slower at rank 16.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import QWEN25_15B_SHAPE, PeakRss, cpu_name, gib, median_seconds, shaped_model_dir
from bench.sync_bench import worker_config
from models import table_logits
from rollout import RolloutWorker, counting_compiles
from rollout.engine import profile_steps
from trainer_bridge import DEFAULT_TARGET_MODULES, LoraConfig, flatten_params, load_hf_params, unflatten_params


@dataclasses.dataclass(frozen=True)
class LoraSyncBenchConfig:
    layers: int = 4
    ranks: tuple[int, ...] = (16, 64)
    repeats: int = 5
    dtype: str = "float32"
    # Decode: prompts x prompt_tokens, n rows each, new_tokens each; 0 decode_repeats skips it.
    decode_repeats: int = 3
    prompts: int = 16
    n: int = 4
    prompt_tokens: int = 64
    new_tokens: int = 32

    def __post_init__(self):
        if self.decode_repeats and self.new_tokens < 4:
            raise ValueError(f"new_tokens must be >= 4 for decode steps to time, got {self.new_tokens}")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    seconds: float
    bytes_copied: int | None = None
    bytes_aliased: int | None = None
    leaves_copied: int | None = None
    compiles: int | None = None  # XLA compilations in the timed calls (their SyncReports)
    extra_rss: int | None = None
    bound: float | None = None  # what the ratio column divides by


def sized_config(model_dir: Path, config: LoraSyncBenchConfig, unmerged: LoraConfig | None):
    """The sync bench's worker, with room for the decode batch twice over (its prompts stay in
    the prefix cache); the same sizes for the merging and the unmerged worker."""
    rows = config.prompts * config.n
    tokens = max(config.prompts * config.prompt_tokens, 256)
    return dataclasses.replace(
        worker_config(model_dir, config.dtype),
        max_total_tokens=max(256, 2 * rows * (config.prompt_tokens + config.new_tokens)),
        context_length=max(256, config.prompt_tokens + config.new_tokens),
        max_running_requests=max(4, rows),
        max_prefill_tokens=tokens,
        chunked_prefill_size=tokens,
        unmerged_lora=unmerged,
    )


def adapter_arrays(flat: dict, lora: LoraConfig) -> dict[str, np.ndarray]:
    """Host float32 factors for every adapted kernel of the flat base, seeded by the rank, sized
    so that the update (alpha/r) A @ B is about half the size of the kernel (whose entries the
    random model draws with std in^-0.5): large enough to change greedy tokens."""
    rng = np.random.default_rng(lora.rank)
    adapters = {}
    for path, leaf in flat.items():
        if path.endswith(".kernel") and path.rsplit(".", 2)[-2] in DEFAULT_TARGET_MODULES:
            module, (in_dim, out_dim) = path.removesuffix(".kernel"), leaf.shape
            a_std, b_std = in_dim**-0.5, 0.5 / (lora.scale * lora.rank**0.5)
            adapters[f"{module}.lora_a"] = (rng.normal(size=(in_dim, lora.rank)) * a_std).astype(np.float32)
            adapters[f"{module}.lora_b"] = (rng.normal(size=(lora.rank, out_dim)) * b_std).astype(np.float32)
    return adapters


def timed_sync(name: str, sync, repeats: int, bound: float | None = None) -> Row:
    """A warm-up call (plans, compiles), then the median of ``repeats``, their reports' last
    bytes and their compilations summed, the peak RSS above the level before them."""
    sync()
    reports = []
    with PeakRss() as rss:
        seconds = median_seconds(lambda: reports.append(sync()), repeats)
    last = reports[-1]
    return Row(
        name,
        seconds,
        last.bytes_copied,
        last.bytes_aliased,
        last.leaves_copied,
        sum(r.compiles for r in reports),
        rss.extra_bytes,
        bound,
    )


def memory_pass(arrays: list, repeats: int) -> float:
    """One pass over ``arrays`` (a jitted ``x + 1`` of each: read once, written once)."""
    bump = jax.jit(lambda xs: [x + 1 for x in xs])
    jax.block_until_ready(bump(arrays))
    return median_seconds(lambda: jax.block_until_ready(bump(arrays)), repeats)


def print_rows(rows: list[Row]) -> None:
    print(
        f"    {'what':50s} {'ms':>9s} {'copied':>11s} {'aliased':>11s} {'leaves cp':>9s} "
        f"{'compiles':>8s} {'peak +RSS':>11s} {'x bound':>8s}"
    )

    def cell(value, fmt):
        return "-" if value is None else fmt(value)

    for r in rows:
        print(
            f"    {r.name:50s} {r.seconds * 1e3:9.1f} {cell(r.bytes_copied, gib):>11s} "
            f"{cell(r.bytes_aliased, gib):>11s} {cell(r.leaves_copied, str):>9s} {cell(r.compiles, str):>8s} "
            f"{cell(r.extra_rss, lambda b: gib(max(b, 0))):>11s} "
            f"{cell(r.bound, lambda b: f'x{r.seconds / b:.2f}'):>8s}"
        )


def head_seconds(table, rows: int, repeats: int) -> float:
    """One tied-head matmul (``models.table_logits``) of ``rows`` hidden rows, the table served."""
    hidden = jnp.ones((rows, table.shape[1]), table.dtype)
    head = jax.jit(table_logits)
    jax.block_until_ready(head(hidden, table))
    return median_seconds(lambda: jax.block_until_ready(head(hidden, table)), repeats)


@dataclasses.dataclass
class Decode:
    seconds: list[float] = dataclasses.field(default_factory=list)  # per call
    steps: list[float] = dataclasses.field(default_factory=list)  # each call's median decode step
    compiles: int = 0
    extra_rss: int = 0


def median_decode_step(times) -> float:
    """The median wall time of a call's decode steps (forward start to the next forward's start)."""
    walls = [b.start - a.start for a, b in zip(times.steps, times.steps[1:]) if a.mode == "decode"]
    return statistics.median(walls)


def decode_pairs(merged: RolloutWorker, unmerged: RolloutWorker, config: LoraSyncBenchConfig, rank: int, zeros, table):
    """A warm-up call on each worker, then ``decode_repeats`` pairs of calls on the same fresh
    prompts (merged first in even pairs, unmerged first in odd ones: a drift of the machine's
    speed cancels), each call's steps timed by the engine's ``profile_steps``, and after each
    pair the tied head's matmul alone (``head_seconds`` of ``table``). Returns (merged,
    unmerged, the head's median seconds, the greedy tokens the two agree on, the same of the
    first 2 tokens of the last prompts with the unmerged worker's adapters zeroed: ``zeros``,
    the base alone, which tells that the agreement means the adapters are applied; this call
    runs last, at the warm-up's shapes)."""
    vocab = QWEN25_15B_SHAPE["vocab_size"]
    rows = config.prompts * config.n
    rng = np.random.default_rng(1000 + rank)
    kwargs = dict(n=config.n, temperature=0.0, ignore_eos=True, seed=0)
    result = {"merged": Decode(), "unmerged": Decode()}
    workers = {"merged": merged, "unmerged": unmerged}

    def prompts():
        return rng.integers(1, vocab, (config.prompts, config.prompt_tokens)).tolist()

    for worker in workers.values():  # compiles the extend and decode shapes of the batch
        worker.generate(prompts(), max_new_tokens=2, **kwargs)
    agree = total = 0
    heads = []
    for i in range(config.decode_repeats):
        batch, outs = prompts(), {}
        for mode in ("merged", "unmerged") if i % 2 == 0 else ("unmerged", "merged"):
            with PeakRss() as rss, counting_compiles() as compiles, profile_steps() as times:
                start = time.perf_counter()
                out = workers[mode].generate(batch, max_new_tokens=config.new_tokens, **kwargs)
                seconds = time.perf_counter() - start
            assert int(out.completion_mask.sum()) == rows * config.new_tokens
            entry = result[mode]
            entry.seconds.append(seconds)
            entry.steps.append(median_decode_step(times))
            entry.compiles += compiles.value
            entry.extra_rss = max(entry.extra_rss, rss.extra_bytes)
            outs[mode] = np.array(out.completions)
        heads.append(head_seconds(table, rows, 3))
        agree += int((outs["merged"] == outs["unmerged"]).sum())
        total += outs["merged"].size
    unmerged.sync_adapters(zeros, check_finite=False)
    base_only = np.array(unmerged.generate(batch, max_new_tokens=2, **kwargs).completions)
    base_agree = float((base_only == outs["merged"][:, :2]).mean())
    return result["merged"], result["unmerged"], statistics.median(heads), agree / max(total, 1), base_agree


def main(config: LoraSyncBenchConfig) -> None:
    started = time.perf_counter()
    print(
        f"CPU: {cpu_name()}; JAX {jax.__version__}, {jax.devices()[0].device_kind}; "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    rows_n = config.prompts * config.n
    # Syncs that take milliseconds, and the pass over the adapters: more repeats (the VM is noisy).
    fast = max(config.repeats, 20)
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = shaped_model_dir(Path(tmp), "qwen2.5-1.5b", config.layers)
        flat = flatten_params(load_hf_params(model_dir))
        with RolloutWorker(sized_config(model_dir, config, None)) as merging:
            shardings = flatten_params(merging.param_shardings())
            base = {
                path: jax.device_put(np.asarray(leaf).astype(jnp.dtype(config.dtype)), shardings[path])
                for path, leaf in flat.items()
            }
            del flat
            tree = unflatten_params(base)
            total = sum(x.nbytes for x in base.values())
            print(
                f"Qwen2.5-1.5B shape, {config.layers} layers, {config.dtype} engines and base tree {gib(total)} "
                f"(placed by param_shardings()), float32 adapters on {', '.join(DEFAULT_TARGET_MODULES)}; "
                f"both workers: max_total_tokens {merging.config.max_total_tokens}, max_running_requests "
                f"{merging.config.max_running_requests}, chunked_prefill_size {merging.config.chunked_prefill_size}"
            )
            merging.sync_params(tree, check_finite=False)
            # On one device of the trainer's; the merge puts them beside their kernels.
            device = next(iter(shardings.values())).mesh.devices.flat[0]
            for rank in config.ranks:
                lora = LoraConfig(rank=rank, alpha=2.0 * rank)
                host = adapter_arrays(base, lora)
                adapter_bytes = sum(x.nbytes for x in host.values())
                kernels = [base[path.removesuffix(".lora_a") + ".kernel"] for path in host if path.endswith("_a")]
                kernel_bytes = sum(x.nbytes for x in kernels)
                print(
                    f"\n  rank {rank}, alpha {lora.alpha:g}: adapters {gib(adapter_bytes)} "
                    f"({adapter_bytes / total:.1%} of the base, {len(host)} factors), adapted kernels "
                    f"{gib(kernel_bytes)}"
                )
                rows = []
                full = timed_sync(
                    "full sync of the base alone (aliased; fixed cost)",
                    lambda: merging.sync_params(tree, check_finite=False),
                    fast,
                )
                rows.append(full)
                kernel_pass = memory_pass(kernels, config.repeats)
                rows.append(Row("memory pass over the adapted kernels", kernel_pass))
                on_device = unflatten_params({p: jax.device_put(x, device) for p, x in host.items()})
                merged = timed_sync(
                    "merged: sync_params(base, adapters)",
                    lambda: merging.sync_params(tree, adapters=on_device, lora=lora, check_finite=False),
                    config.repeats,
                    bound=kernel_pass + full.seconds,
                )
                rows.append(merged)
                with RolloutWorker(sized_config(model_dir, config, lora)) as unmerging:
                    # Where the engine serves the factors: a sync aliases arrays placed there.
                    placed_at = flatten_params(unmerging.adapter_shardings())
                    placed = {path: jax.device_put(x, placed_at[path]) for path, x in host.items()}
                    nested = unflatten_params(placed)
                    adapter_pass = memory_pass(list(placed.values()), fast)
                    rows.append(Row("memory pass over the adapters", adapter_pass))
                    bound = adapter_pass + full.seconds
                    unmerged = timed_sync(
                        "unmerged: sync_params(base, adapters), placed",
                        lambda: unmerging.sync_params(tree, adapters=nested, lora=lora, check_finite=False),
                        fast,
                        bound=bound,
                    )
                    rows.append(unmerged)
                    only = timed_sync(
                        "unmerged: sync_adapters(adapters), placed",
                        lambda: unmerging.sync_adapters(nested, check_finite=False),
                        fast,
                        bound=bound,
                    )
                    rows.append(only)
                    # A leaf passed again as the array the engine serves is not read again for
                    # NaN: alternate two sets of placed arrays, as a trainer passes new ones.
                    twin = {path: jax.device_put(x, placed_at[path]) for path, x in host.items()}
                    twins = itertools.cycle([unflatten_params(twin), nested])
                    rows.append(
                        timed_sync(
                            "unmerged: sync_adapters, placed, check_finite",
                            lambda: unmerging.sync_adapters(next(twins)),
                            fast,
                            bound=bound,
                        )
                    )
                    host_tree = unflatten_params(host)
                    copied = timed_sync(
                        "unmerged: sync_adapters(adapters), host numpy",
                        lambda: unmerging.sync_adapters(host_tree, check_finite=False),
                        fast,
                        bound=bound,
                    )
                    rows.append(copied)
                    # Decode serves the adapters synced with the base, placed (as for decode
                    # on the merging worker, whose last sync merged the same adapters).
                    unmerging.sync_params(tree, adapters=nested, lora=lora, check_finite=False)
                    print_rows(rows)
                    print(
                        f"    merged: its report counts the adapted kernels as aliased (merged before the plan "
                        f"runs); it writes {gib(kernel_bytes)} of them, which the engine holds beside the trainer's "
                        f"tree. Unmerged: sync_params aliased {gib(unmerged.bytes_aliased)} (base + adapters "
                        f"{gib(total + adapter_bytes)}), copied {gib(unmerged.bytes_copied)}; sync_adapters of host "
                        f"adapters copied {copied.bytes_copied / adapter_bytes:.2f}x the adapter bytes. Merged sync "
                        f"x{merged.seconds / only.seconds:.0f} the time of sync_adapters (placed)"
                    )
                    if config.decode_repeats:
                        zeros = {p: jax.device_put(np.zeros_like(x), placed_at[p]) for p, x in host.items()}
                        zeros = unflatten_params(zeros)
                        table = base["model.embed_tokens.embedding"]
                        dm, du, head_s, agree, base_agree = decode_pairs(merging, unmerging, config, rank, zeros, table)
                        tokens = rows_n * config.new_tokens
                        ms, us = statistics.median(dm.seconds), statistics.median(du.seconds)
                        ratio = statistics.median(u / m for u, m in zip(du.seconds, dm.seconds))
                        step_ratios = [u / m for u, m in zip(du.steps, dm.steps)]
                        step_ratio = statistics.median(step_ratios)
                        m_step, u_step = statistics.median(dm.steps), statistics.median(du.steps)
                        extra = (step_ratio - 1) * m_step
                        print(
                            f"    decode ({config.prompts} prompts x {config.prompt_tokens} tokens, n={config.n}: "
                            f"{rows_n} rows, {config.new_tokens} new, greedy, prefill included; {len(dm.seconds)} "
                            f"pairs): merged {ms:.2f} s ({tokens / ms:.1f} new tokens/s), unmerged {us:.2f} s "
                            f"({tokens / us:.1f} new tokens/s): unmerged/merged time x{ratio:.3f} (median of the "
                            f"pair ratios {', '.join(f'{u / m:.3f}' for u, m in zip(du.seconds, dm.seconds))})"
                        )
                        print(
                            f"      decode step (median per call, engine profile): merged {m_step * 1e3:.1f} ms, "
                            f"unmerged {u_step * 1e3:.1f} ms: x{step_ratio:.3f} (pair ratios "
                            f"{', '.join(f'{r:.3f}' for r in step_ratios)}); the tied LM head alone (jitted, "
                            f"{rows_n} rows) {head_s * 1e3:.0f} ms, {head_s / m_step:.0%} of the merged step: "
                            f"the unmerged step's extra (by the ratio) {extra * 1e3:+.1f} ms is "
                            f"{extra / (m_step - head_s):+.1%} of the rest of it (the layers' share, which grows "
                            f"with depth: 28 layers in the real model)"
                        )
                        print(
                            f"      greedy tokens equal {agree:.1%} (the first 2 of the last prompts' with zero "
                            f"adapters: {base_agree:.1%}); compilations in the timed calls {dm.compiles} / "
                            f"{du.compiles}; peak RSS above each call's start +{gib(max(dm.extra_rss, 0))} / "
                            f"+{gib(max(du.extra_rss, 0))}"
                        )
                        decode = (ratio, step_ratio, extra / (m_step - head_s))
                    else:
                        decode = None
                summary.append((rank, merged, unmerged, only, copied, bound, adapter_bytes, kernel_bytes, decode))
    print(f"\nagainst the issue's targets ({time.perf_counter() - started:.0f} s in all):")
    for rank, merged, unmerged, only, copied, bound, adapter_bytes, kernel_bytes, decode in summary:
        moved_ok = copied.bytes_copied == adapter_bytes and only.bytes_copied == 0 and unmerged.bytes_copied == 0
        worst = max(copied.seconds, only.seconds) / bound
        print(
            f"  rank {rank}: adapter-only sync moves only adapter bytes: {'met' if moved_ok else 'NOT met'} (host "
            f"adapters {gib(copied.bytes_copied)} copied of {gib(adapter_bytes)}; placed ones "
            f"{only.bytes_copied} bytes; sync_params copied {unmerged.bytes_copied} bytes of the base)"
        )
        print(
            f"    its time <= 2x one pass over the adapters + the fixed cost: {'met' if worst <= 2 else 'NOT met'} "
            f"(host x{copied.seconds / bound:.2f}, placed x{only.seconds / bound:.2f}); the merged sync "
            f"x{merged.seconds / merged.bound:.2f} its own bound (one pass over the adapted kernels + the fixed cost)"
        )
        if decode is not None:
            ratio, step_ratio, layers = decode
            verdict = "met" if max(ratio, step_ratio) <= 1.10 else "NOT met"
            print(
                f"    decode unmerged/merged: the call x{ratio:.3f}, its decode step x{step_ratio:.3f} "
                f"(target <= 1.10 at rank 16: {verdict if rank == 16 else 'n/a'}); the step's "
                f"extra {layers:+.1%} of the step less the LM head"
            )
        print(
            f"    peak RSS above the level before the timed syncs: merged {gib(max(merged.extra_rss, 0))}, unmerged "
            f"sync_params {gib(max(unmerged.extra_rss, 0))}, sync_adapters placed {gib(max(only.extra_rss, 0))} "
            f"/ host {gib(max(copied.extra_rss, 0))}; held by the engine beyond the trainer's tree: merged "
            f"{gib(kernel_bytes)} (its merged kernels), unmerged 0 (placed adapters) or {gib(copied.bytes_copied)} "
            f"(host adapters)"
        )
    print(f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def parse_args() -> LoraSyncBenchConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = LoraSyncBenchConfig()
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--ranks", default=",".join(map(str, d.ranks)))
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype)
    parser.add_argument("--decode-repeats", type=int, default=d.decode_repeats, help="0 skips decode")
    parser.add_argument("--prompts", type=int, default=d.prompts)
    parser.add_argument("--n", type=int, default=d.n)
    parser.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    parser.add_argument("--new-tokens", type=int, default=d.new_tokens)
    args = parser.parse_args()
    return LoraSyncBenchConfig(
        layers=args.layers,
        ranks=tuple(int(r) for r in args.ranks.split(",")),
        repeats=args.repeats,
        dtype=args.dtype,
        decode_repeats=args.decode_repeats,
        prompts=args.prompts,
        n=args.n,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
    )


if __name__ == "__main__":
    main(parse_args())
