"""Multi-turn episodes: the prefill the prefix cache and session pins save, and the wall time.

    python -m bench.episodes_bench [--prompts 16] [--n 4] [--turns 4] [--new-tokens 16] [--repeats 3]
                                   [--small-pool TOKENS] [--env-delay S] [--decode-steps K]

``prompts`` x ``n`` episodes (64) of ``turns`` turns (4) on the tiny chat model (2-layer Qwen2,
hidden 256, byte-level BPE, ChatML template; float32): each turn samples ``new_tokens`` tokens
(temperature 1, ``ignore_eos``), the environment answers with a short user message (``now
3+1=``: 7 tokens, 26 with the template's framing around it) and says done after the last turn.
The same seed in every variant, each in its own worker (start-up untimed: the engine precompiles
its shapes there), one warm-up run, then the median of ``repeats`` timed runs, the prefix cache
flushed before each (a ``sync_params`` of the same weights):

- ``cache + pins``: the default; each episode's conversation pinned in the prefix cache between
  its turns, so a turn prefills only what was appended (``EpisodeTurn.prefill_tokens``);
- ``cache, no pins``: ``EpisodeLimits(pin_prefix=False)``: the cache keeps what nothing evicted;
- ``no cache``: ``WorkerConfig(prefix_cache=False)``: every turn prefills the whole conversation
  (the baseline: total prefill = total prompt tokens).

The KV pool (32768 tokens) holds every conversation, so nothing is evicted and pins change
nothing. ``--small-pool TOKENS`` adds the first two variants again with a pool of that many
tokens (sessions may pin half of it, the default), where running turns evict unpinned
conversations; ``--env-delay S``: each environment step sleeps a random 0..S seconds (a tool
call; drawn for each step, the same draws in every run), which leaves conversations idle in the
cache while other episodes' turns need its memory; ``--decode-steps K`` adds the default
variant with ``WorkerConfig(decode_steps=K)`` (turns arrive while others decode: each waits for
the running chunks' steps, then joins) and reports its chunks.

Per variant: the turns' prefill (the sum of ``EpisodeTurn.prefill_tokens``, by turn: the tokens
the engine's prefills computed, a turn it retracted when the pool ran out and prefilled again
counted in full), the prompt tokens (what re-prefilling every conversation costs), the sampled
tokens, forwards and the wall time, with ratios to the no-cache baseline of
the same run; and the checks: with the cache and pins, every turn after the first prefills
exactly the tokens appended since the previous one plus that turn's last sampled token (no
forward took it); without the cache nothing is found cached.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import astuple
from pathlib import Path

import jax

from bench.common import cpu_name
from models import TinyModelSpec, write_tiny_model
from rollout import RolloutWorker, WorkerConfig
from rollout.compiles import counting_compiles
from rollout.episodes import EpisodeBatch, EpisodeLimits, StepResult, Turn
from trainer_bridge import load_hf_params

SEED = 7
POOL = 32768


@dataclasses.dataclass(frozen=True)
class EpisodesBenchConfig:
    prompts: int = 16
    n: int = 4
    turns: int = 4
    new_tokens: int = 16
    repeats: int = 3
    small_pool: int | None = None
    env_delay: float = 0.0
    precompile: bool = True
    decode_steps: int | None = None


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    prefix_cache: bool
    pin_prefix: bool
    pool: int
    decode_steps: int = 1


class Chat:
    """Answers every turn with a short user message; done after ``turns`` turns. ``delay``: each
    step first sleeps a random 0..delay seconds (the same draws in every run)."""

    def __init__(self, i: int, j: int, turns: int, delay: float):
        self.i, self.turns, self.delay = i, turns, delay
        self.rng = random.Random(i * 1000 + j)

    async def step(self, turn: Turn) -> StepResult:
        if self.delay:
            await asyncio.sleep(self.rng.uniform(0, self.delay))
        if turn.index + 1 == self.turns:
            return StepResult(reward=1.0, done=True)
        return StepResult(observation=f"now {self.i}+{turn.index + 1}=")


def prompts(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"question: {i}+{2 * i + 3}= answer:"}] for i in range(count)]


def figures(out: EpisodeBatch) -> dict:
    """Token counts of one run (from its EpisodeTurns), and where each later turn's prefill came from."""
    turns = [t for e in out.episodes for t in e.turns]
    appended_plus_one = sum(
        turn.prefill_tokens == before.observation_end - before.end + 1
        for e in out.episodes
        for before, turn in zip(e.turns, e.turns[1:])
    )
    most = max(len(e.turns) for e in out.episodes)
    return {
        "prefill_tokens": sum(e.prefill_tokens for e in out.episodes),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "sampled_tokens": sum(t.end - t.start for t in turns),
        "appended_tokens": sum(t.observation_end - t.end for t in turns),
        "first_prompt_tokens": sum(e.prompt_length for e in out.episodes),
        "prefill_by_turn": [
            sum(e.turns[k].prefill_tokens for e in out.episodes if len(e.turns) > k) for k in range(most)
        ],
        "turns": len(turns),
        "later_turns": len(turns) - len(out.episodes),
        "later_turns_appended_plus_one": appended_plus_one,
        "cached_over_prompt": sum(t.cached_tokens > t.prompt_tokens for t in turns),
        "statuses": sorted({e.status for e in out.episodes}),
        "finish_reasons": sorted({t.finish_reason for t in turns}),
    }


def measure(variant: Variant, model_dir: Path, config: EpisodesBenchConfig) -> dict:
    worker_config = WorkerConfig(
        model_path=str(model_dir),
        dtype="float32",
        devices=tuple(jax.devices()[:1]),
        max_total_tokens=variant.pool,
        context_length=512,
        max_running_requests=config.prompts * config.n,
        max_prefill_tokens=1024,
        chunked_prefill_size=1024,
        prefix_cache=variant.prefix_cache,
        precompile=config.precompile,  # every prefill and decode shape at start-up: none compiles in a timed run
        decode_steps=variant.decode_steps,
    )
    limits = EpisodeLimits(max_turns=config.turns, max_new_tokens=config.new_tokens, pin_prefix=variant.pin_prefix)
    started = time.perf_counter()
    with RolloutWorker(worker_config) as worker:
        params = jax.device_put(load_hf_params(model_dir), worker.param_shardings())
        start_up = time.perf_counter() - started

        def run() -> dict:
            worker.sync_params(params)  # the same weights: flushes the prefix cache
            forwards, chunks = worker.engine.forward_count, worker.engine.decode_chunk_stats
            with counting_compiles() as compiles:
                start = time.perf_counter()
                out = worker.run_episodes(
                    prompts(config.prompts),
                    lambda i, j: Chat(i, j, config.turns, config.env_delay),
                    n=config.n,
                    limits=limits,
                    seed=SEED,
                    temperature=1.0,
                    ignore_eos=True,
                )
                seconds = time.perf_counter() - start
            chunks_after = worker.engine.decode_chunk_stats
            return {
                "wall_s": seconds,
                "forwards": worker.engine.forward_count - forwards,
                "chunks": None if chunks is None else [b - a for a, b in zip(astuple(chunks), astuple(chunks_after))],
                "compiles": compiles.value,
                **figures(out),
                "_tokens": [e.token_ids for e in out.episodes],
            }

        warm = run()
        runs = [run() for _ in range(config.repeats)]
        stats = worker.session_stats()[0]
        assert stats.sessions == 0, "an episode left its session pinned"
    by_wall = sorted(runs, key=lambda r: r["wall_s"])
    median = by_wall[(len(runs) - 1) // 2]  # the median run (the lower one of an even count)
    varying = ("wall_s", "forwards", "compiles")
    return {
        "variant": variant.name,
        "prefix_cache": variant.prefix_cache,
        "pin_prefix": variant.pin_prefix,
        "pool_tokens": variant.pool,
        "decode_steps": variant.decode_steps,
        "start_up_s": start_up,
        "warm_up_s": warm["wall_s"],
        "warm_up_compiles": warm["compiles"],
        **median,
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        **{f"{k}_each": [r[k] for r in runs] for k in (*varying, "prefill_tokens")},
        # Every run samples the same conversations (the same seed).
        "same_conversations": all(r["_tokens"] == runs[0]["_tokens"] for r in runs),
        "pins_made": stats.pins_made,
        "released_for_budget": stats.released_for_budget,
        "session_budget_tokens": stats.budget_tokens,
    }


def main(config: EpisodesBenchConfig) -> None:
    print(
        f"CPU: {cpu_name()}; jax {jax.__version__}, {jax.default_backend()} backend, "
        f"{jax.device_count()} devices (engine on 1); load average {os.getloadavg()[0]:.2f}"
    )
    episodes = config.prompts * config.n
    print(
        f"{config.prompts} prompts x n={config.n} = {episodes} episodes x {config.turns} turns x {config.new_tokens} "
        f"sampled tokens (temperature 1, ignore_eos, seed {SEED}); tiny chat model, float32; "
        f"median of {config.repeats} timed runs after a warm-up run"
        + (f"; environment steps sleep 0..{config.env_delay} s" if config.env_delay else "")
    )
    variants = [
        Variant("cache + pins", True, True, POOL),
        Variant("cache, no pins", True, False, POOL),
        Variant("no cache", False, False, POOL),
    ]
    if config.decode_steps:
        steps = config.decode_steps
        variants.append(Variant(f"cache + pins, decode_steps={steps}", True, True, POOL, steps))
    if config.small_pool:
        variants += [
            Variant("cache + pins", True, True, config.small_pool),
            Variant("cache, no pins", True, False, config.small_pool),
        ]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp), TinyModelSpec(chat_template=True))
        for variant in variants:
            r = measure(variant, model_dir, config)
            results.append(r)
            print(
                f"  {r['variant']}, pool {r['pool_tokens']}: {r['wall_s']:.3f} s (each "
                f"{', '.join(f'{s:.3f}' for s in r['wall_s_each'])}; start-up {r['start_up_s']:.1f} s, warm-up "
                f"{r['warm_up_s']:.2f} s with {r['warm_up_compiles']} compiles), prefill {r['prefill_tokens']} tokens",
                flush=True,
            )
    base = next(r for r in results if not r["prefix_cache"])
    print()
    print(
        "| variant | KV pool | prefill tokens (turns' sum) | prompt tokens (re-prefill all) | x baseline's prefill | "
        f"by turn {' / '.join(str(k + 1) for k in range(config.turns))} | "
        "sampled | forwards | wall s (median) | x baseline's wall |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['variant']} | {r['pool_tokens']} | {r['prefill_tokens']} | {r['prompt_tokens']} | "
            f"{r['prefill_tokens'] / base['prefill_tokens']:.3f} | {' / '.join(map(str, r['prefill_by_turn']))} | "
            f"{r['sampled_tokens']} | {r['forwards']} | "
            f"{r['wall_s']:.3f} | {r['wall_s'] / base['wall_s']:.2f} |"
        )
    print()
    for r in results:
        same = sum(a == b for a, b in zip(r["_tokens"], base["_tokens"]))
        notes = [
            f"later turns prefilling exactly the appended tokens + 1: "
            f"{r['later_turns_appended_plus_one']}/{r['later_turns']}",
            f"turns the engine retracted and prefilled again (its cache hits counted twice, cached > prompt): "
            f"{r['cached_over_prompt']}",
            f"first prompts {r['first_prompt_tokens']} tokens, appended {r['appended_tokens']} "
            f"({r['appended_tokens'] / max(r['later_turns'], 1):.1f} a turn, framing included)",
            f"conversations equal to the baseline's: {same}/{len(base['_tokens'])}, the same in every run: "
            f"{r['same_conversations']}",
            f"statuses {r['statuses']}, finish reasons {r['finish_reasons']}",
            f"each run: prefill {r['prefill_tokens_each']}, compiles {r['compiles_each']}",
        ]
        if r["chunks"] is not None:
            dispatched, served, discarded = r["chunks"]
            notes.append(f"chunks dispatched {dispatched}, steps served {served}, row-steps thrown away {discarded}")
        if r["prefix_cache"]:
            notes.append(
                f"pins made {r['pins_made']}, released for the budget ({r['session_budget_tokens']} tokens): "
                f"{r['released_for_budget']}"
            )
        print(f"  {r['variant']}, pool {r['pool_tokens']}: " + "; ".join(notes))
    summary = {"jax": jax.__version__, "cpu": cpu_name(), **dataclasses.asdict(config)}
    print(json.dumps(summary | {"results": [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]}))
    pinned = results[0]
    if pinned["later_turns_appended_plus_one"] != pinned["later_turns"]:
        raise SystemExit("check failed: with the cache and pins, a later turn prefilled more than it appended + 1")
    if base["prefill_tokens"] != base["prompt_tokens"]:
        raise SystemExit("check failed: without the cache, a turn found cached tokens")


def parse_args() -> EpisodesBenchConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = EpisodesBenchConfig()
    parser.add_argument("--prompts", type=int, default=d.prompts)
    parser.add_argument("--n", type=int, default=d.n)
    parser.add_argument("--turns", type=int, default=d.turns)
    parser.add_argument("--new-tokens", type=int, default=d.new_tokens)
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--small-pool", type=int, default=d.small_pool)
    parser.add_argument("--env-delay", type=float, default=d.env_delay)
    parser.add_argument("--no-precompile", action="store_true", help="compile in the warm-up run instead")
    parser.add_argument("--decode-steps", type=int, default=d.decode_steps, help="add a variant with decode chunks")
    a = parser.parse_args()
    return EpisodesBenchConfig(
        a.prompts, a.n, a.turns, a.new_tokens, a.repeats, a.small_pool, a.env_delay, not a.no_precompile, a.decode_steps
    )


if __name__ == "__main__":
    main(parse_args())
