"""Flax (linen) Qwen2/Qwen2.5/Qwen3 causal LM with the MLLM-JAX parameter layout.

Params: ``{'model': {'embed_tokens': {'embedding' [V, H]}, 'layers_0': {'self_attn':
{'q_proj': {'kernel' [in, out], 'bias'}, ..., 'q_norm': {'scale'} (Qwen3)}, 'mlp': {...},
'input_layernorm': {'scale'}, 'post_attention_layernorm': {'scale'}}, ..., 'norm': {'scale'}},
'lm_head': {'kernel' [H, V]}}``. With tied embeddings there is no ``lm_head``: the logits use the
embedding matrix, so the trainer trains one matrix, as the engine serves one.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class QwenConfig:
    architecture: str  # "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    dtype: str = "float32"

    @property
    def attention_bias(self) -> bool:
        return self.architecture == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @classmethod
    def from_hf(cls, source: str | Path | dict, dtype: str = "float32") -> QwenConfig:
        """From an HF ``config.json`` (a model dir, the file, or its parsed dict)."""
        if not isinstance(source, dict):
            path = Path(source)
            path = path / "config.json" if path.is_dir() else path
            source = json.loads(path.read_text())
        model_type = source.get("model_type")
        if model_type not in ("qwen2", "qwen3"):
            raise ValueError(f"model_type {model_type!r} is not supported (qwen2 or qwen3)")
        heads = source["num_attention_heads"]
        return cls(
            architecture=model_type,
            vocab_size=source["vocab_size"],
            hidden_size=source["hidden_size"],
            intermediate_size=source["intermediate_size"],
            num_hidden_layers=source["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=source.get("num_key_value_heads", heads),
            head_dim=source.get("head_dim") or source["hidden_size"] // heads,
            rope_theta=float(source.get("rope_theta", 1_000_000.0)),
            rms_norm_eps=float(source.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(source.get("tie_word_embeddings", True)),
            dtype=dtype,
        )


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * scale.astype(jnp.float32)).astype(self.dtype)


def apply_rope(x, positions, theta: float):
    """Rotary embedding, rotate-half (NeoX) convention as in HF Qwen. x: [B, T, heads, D]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(jnp.concatenate([freqs, freqs], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([freqs, freqs], -1))[:, :, None, :]
    x32 = x.astype(jnp.float32)
    half = dim // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


class Attention(nn.Module):
    config: QwenConfig

    @nn.compact
    def __call__(self, x, positions, mask):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        dense = partial(nn.Dense, dtype=dtype, param_dtype=dtype)
        batch, length, _ = x.shape
        q = dense(c.num_attention_heads * c.head_dim, use_bias=c.attention_bias, name="q_proj")(x)
        k = dense(c.num_key_value_heads * c.head_dim, use_bias=c.attention_bias, name="k_proj")(x)
        v = dense(c.num_key_value_heads * c.head_dim, use_bias=c.attention_bias, name="v_proj")(x)
        q = q.reshape(batch, length, c.num_attention_heads, c.head_dim)
        k = k.reshape(batch, length, c.num_key_value_heads, c.head_dim)
        v = v.reshape(batch, length, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, dtype, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, dtype, name="k_norm")(k)
        q = apply_rope(q, positions, c.rope_theta)
        k = apply_rope(k, positions, c.rope_theta)
        groups = c.num_attention_heads // c.num_key_value_heads
        k = jnp.repeat(k, groups, axis=2)
        v = jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(c.head_dim)
        scores = jnp.where(mask[:, None, :, :], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, -1)
        return dense(c.hidden_size, use_bias=False, name="o_proj")(out)


class MLP(nn.Module):
    config: QwenConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        dense = partial(nn.Dense, use_bias=False, dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.dtype))
        gate = dense(c.intermediate_size, name="gate_proj")(x)
        up = dense(c.intermediate_size, name="up_proj")(x)
        return dense(c.hidden_size, name="down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    config: QwenConfig

    @nn.compact
    def __call__(self, x, positions, mask):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        h = RMSNorm(c.rms_norm_eps, dtype, name="input_layernorm")(x)
        x = x + Attention(c, name="self_attn")(h, positions, mask)
        h = RMSNorm(c.rms_norm_eps, dtype, name="post_attention_layernorm")(x)
        return x + MLP(c, name="mlp")(h)


class QwenModel(nn.Module):
    config: QwenConfig

    def setup(self):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype)
        self.layers = [DecoderLayer(c) for _ in range(c.num_hidden_layers)]  # named layers_{i}
        self.norm = RMSNorm(c.rms_norm_eps, dtype)

    def __call__(self, tokens, positions, mask):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, positions, mask)
        return self.norm(x)

    def attend(self, hidden):
        return self.embed_tokens.attend(hidden)


class QwenForCausalLM(nn.Module):
    """``apply({'params': params}, tokens, attention_mask)`` -> logits [B, T, V] (float32)."""

    config: QwenConfig

    def setup(self):
        c = self.config
        self.model = QwenModel(c)
        if not c.tie_word_embeddings:
            dtype = jnp.dtype(c.dtype)
            self.lm_head = nn.Dense(c.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype)

    def __call__(self, tokens, attention_mask=None, positions=None):
        return self.logits(self.hidden_states(tokens, attention_mask, positions))

    def hidden_states(self, tokens, attention_mask=None, positions=None):
        """The final-norm hidden states [B, T, H] the logits are read from (a value head reads them too)."""
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, dtype=bool)
        attention_mask = attention_mask.astype(bool)
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
        length = tokens.shape[1]
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))
        mask = causal[None, :, :] & attention_mask[:, None, :]
        return self.model(tokens, positions, mask)

    def logits(self, hidden):
        if self.config.tie_word_embeddings:
            logits = self.model.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        return logits.astype(jnp.float32)


def greedy_decode(model: QwenForCausalLM, params, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference greedy decoding (full forward each step, no KV cache): for parity tests."""
    width = max(len(p) for p in prompts)
    total = width + max_new_tokens
    tokens = np.zeros((len(prompts), total), dtype=np.int32)
    mask = np.zeros((len(prompts), total), dtype=bool)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) : width] = prompt
        mask[row, width - len(prompt) : width] = True

    @jax.jit
    def next_token(params, tokens, mask, index):
        logits = model.apply({"params": params}, tokens, mask)
        return jnp.argmax(logits[:, index - 1], axis=-1)

    for step in range(max_new_tokens):
        index = width + step
        tokens[:, index] = np.asarray(next_token(params, tokens, mask, index))
        mask[:, index] = True
    return tokens[:, width:].tolist()
