"""Rollout batches: what ``RolloutWorker.generate`` returns to a trainer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """Completions for ``len(prompts)`` prompts, ``n`` samples each, in prompt-major order.

    Row ``i`` is sample ``i % n`` of prompt ``prompt_index[i] == i // n``. The padded arrays
    put every prompt right-aligned in the first ``prompt_width`` columns (left padding) and
    every completion left-aligned after it, so completion ``j`` of every row sits in column
    ``prompt_width + j``; the completion region is ``max_new_tokens`` wide (an episode batch's:
    its ``completion_width``), a fixed shape for a jitted train step.
    """

    prompts: list[list[int]]
    completions: list[list[int]]
    prompt_index: np.ndarray  # [B] int32
    finish_reasons: list[str]
    tokens: np.ndarray  # [B, T] int32, pad_token_id where padded
    attention_mask: np.ndarray  # [B, T] bool, True on prompt and completion tokens
    completion_mask: np.ndarray  # [B, T] bool, True on completion tokens
    positions: np.ndarray  # [B, T] int32, position of each token in its own sequence
    prompt_width: int
    n: int
    weight_version: int  # the version when the call was admitted (per token: token_versions)
    seeds: np.ndarray  # [B] int64, the sampling seed of each row
    # XLA compilations in the process during the call (JAX compile events); 0 proves none.
    compiles: int = 0
    # Each completion's text: special tokens skipped, tool-call markup kept (chat.completion_text).
    completion_texts: list[str] | None = None
    # [B, T] float32 aligned with ``tokens`` (generate(..., return_logprobs=True), else None):
    # the log-prob of each completion token under the distribution the engine drew it from,
    # 0 where there is no sampled token. See models/logprobs.py.
    logprobs: np.ndarray | None = None
    # [B, T] int64 aligned with ``tokens``: the weight version whose forward sampled each
    # completion token (swaps in flight change it mid-row; ``weight_version`` is the version
    # when the call was admitted), -1 where there is no sampled token.
    token_versions: np.ndarray | None = None
    # [B, T] int32 aligned with ``tokens``, with ``logprobs``: how many tokens the distribution
    # of each completion token kept after top-k, top-p and min-p (the vocabulary size where
    # nothing was filtered), 0 where there is no sampled token. A trainer that recomputes the
    # log-probs keeps that many (``models.completion_log_probs(..., kept_counts=...)``): the same
    # tokens as the engine, whatever its own logits' last bits say about the top-p boundary.
    kept_counts: np.ndarray | None = None
    # [B, T, MoE layers, top_k] int8/int16 aligned with ``tokens`` (generate(...,
    # return_routing=True), MoE models): the experts the engine routed each token to, -1 where
    # no forward took the token as input (padding, each completion's last token). A trainer
    # replays them (``CausalLM.apply(..., routed_experts=...)``) to route as the engine did.
    routed_experts: np.ndarray | None = None
    # [B] int32: the prompt tokens of each row the engine held in its prefix cache when the call
    # came (not prefilled by this call); 0 where a row shared nothing with the cache. A prompt's
    # n samples share one prefill: each reports the same.
    cached_tokens: np.ndarray | None = None
    # [B] int32: the tokens each row's prefills computed (its prompt less what the cache held;
    # a row the engine retracted under memory pressure and prefilled again counts both). A
    # prompt's shared prefill counts on its first row: the rows add up to the call's prefill.
    prefill_tokens: np.ndarray | None = None

    @property
    def size(self) -> int:
        return len(self.completions)

    @property
    def completion_lengths(self) -> np.ndarray:
        return np.array([len(c) for c in self.completions], dtype=np.int32)

    @property
    def weight_versions(self) -> np.ndarray:
        """[B] int64: the weight version each row started with (``weight_version``)."""
        return np.full(self.size, self.weight_version, dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    """New tokens of one row of a streamed generate call (``RolloutWorker.astream``)."""

    row: int  # prompt-major row, as in RolloutBatch
    prompt_index: int
    sample_index: int
    token_ids: list[int]  # tokens since this row's previous chunk
    finish_reason: str | None  # set on the row's last chunk
    weight_version: int
    logprobs: list[float] | None = None  # of token_ids, with return_logprobs=True
    token_versions: list[int] | None = None  # the weight version that sampled each of token_ids
    # The prompt tokens the engine held in its prefix cache when the call came (as
    # RolloutBatch.cached_tokens; known once the row is prefilled).
    cached_tokens: int | None = None


def pack_rollouts(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    n: int,
    completion_width: int,
    pad_token_id: int,
    finish_reasons: Sequence[str],
    weight_version: int,
    seeds: np.ndarray,
    compiles: int = 0,
    completion_texts: list[str] | None = None,
    prompt_width: int | None = None,
    logprobs: Sequence[Sequence[float]] | None = None,
    token_versions: Sequence[Sequence[int]] | None = None,
    kept_counts: Sequence[Sequence[int]] | None = None,
    routed_experts: Sequence[np.ndarray | None] | None = None,
    cached_tokens: Sequence[int] | None = None,
    prefill_tokens: Sequence[int] | None = None,
) -> RolloutBatch:
    """Lay out prompt-major completions as left-padded prompts followed by completions.

    The prompt region is ``prompt_width`` wide when given (a fixed shape for a jitted train
    step), else as wide as the longest prompt.
    """
    rows = len(completions)
    if rows != len(prompts) * n:
        raise ValueError(f"expected {len(prompts) * n} completions ({len(prompts)} prompts x n={n}), got {rows}")
    longest_prompt = max(len(p) for p in prompts)
    if prompt_width is None:
        prompt_width = longest_prompt
    elif longest_prompt > prompt_width:
        raise ValueError(f"a prompt has {longest_prompt} tokens, more than prompt_width={prompt_width}")
    longest = max((len(c) for c in completions), default=0)
    if longest > completion_width:
        raise ValueError(f"a completion has {longest} tokens, more than the width {completion_width}")
    width = prompt_width + completion_width
    tokens = np.full((rows, width), pad_token_id, dtype=np.int32)
    attention = np.zeros((rows, width), dtype=bool)
    completion_mask = np.zeros((rows, width), dtype=bool)
    prompt_index = np.repeat(np.arange(len(prompts), dtype=np.int32), n)
    for row, (p, c) in enumerate(zip((prompts[i] for i in prompt_index), completions)):
        start = prompt_width - len(p)
        tokens[row, start:prompt_width] = p
        tokens[row, prompt_width : prompt_width + len(c)] = c
        attention[row, start : prompt_width + len(c)] = True
        completion_mask[row, prompt_width : prompt_width + len(c)] = True
    positions = np.maximum(np.cumsum(attention, axis=1) - 1, 0).astype(np.int32)

    def per_token(values, what: str, dtype, fill):
        """[B, T] of one value per completion token, ``fill`` elsewhere (None stays None)."""
        if values is None:
            return None
        array = np.full((rows, width), fill, dtype=dtype)
        for row, (c, row_values) in enumerate(zip(completions, values)):
            if len(row_values) != len(c):
                raise ValueError(f"row {row}: {len(row_values)} {what} for a completion of {len(c)} tokens")
            array[row, prompt_width : prompt_width + len(c)] = row_values
        return array

    routing = None
    recorded = [r for r in routed_experts or () if r is not None]
    if recorded:
        routing = np.full((rows, width) + recorded[0].shape[1:], -1, recorded[0].dtype)
        for row, (p, c, row_routing) in enumerate(zip((prompts[i] for i in prompt_index), completions, routed_experts)):
            if row_routing is None:  # an aborted row: none
                continue
            positions_routed = len(p) + len(c) - 1
            if len(row_routing) < positions_routed:
                raise ValueError(f"row {row}: routing for {len(row_routing)} positions, expected {positions_routed}")
            start = prompt_width - len(p)
            routing[row, start : start + positions_routed] = row_routing[:positions_routed]

    return RolloutBatch(
        prompts=[list(map(int, p)) for p in prompts],
        completions=[list(map(int, c)) for c in completions],
        prompt_index=prompt_index,
        finish_reasons=list(finish_reasons),
        tokens=tokens,
        attention_mask=attention,
        completion_mask=completion_mask,
        positions=positions,
        prompt_width=prompt_width,
        n=n,
        weight_version=weight_version,
        seeds=np.asarray(seeds, dtype=np.int64),
        compiles=compiles,
        completion_texts=completion_texts,
        logprobs=per_token(logprobs, "log-probs", np.float32, 0),
        token_versions=per_token(token_versions, "token versions", np.int64, -1),
        kept_counts=per_token(kept_counts, "kept counts", np.int32, 0),
        routed_experts=routing,
        cached_tokens=None if cached_tokens is None else np.asarray(cached_tokens, dtype=np.int32),
        prefill_tokens=None if prefill_tokens is None else np.asarray(prefill_tokens, dtype=np.int32),
    )
