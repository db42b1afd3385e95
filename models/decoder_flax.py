"""Flax (linen) Qwen2/Qwen2.5/Qwen3 and Llama causal LM with the MLLM-JAX parameter layout.

One decoder for the three families: Qwen2 adds q/k/v biases, Qwen3 qk-norm, Llama neither (and
may scale its RoPE frequencies the Llama 3 way, ``rope_scaling.rope_type == "llama3"``).

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

from .hf_config import with_hf_defaults
from .logprobs import table_logits


@dataclasses.dataclass(frozen=True)
class DenseArchitecture:
    """What sets one dense family's decoder apart from the others (by HF ``model_type``)."""

    hf_class: str  # config.json "architectures": the class transformers and the engine load
    attention_bias: bool = False  # biases on the q, k and v projections
    qk_norm: bool = False  # an RMSNorm of each head's q and k before RoPE


ARCHITECTURES = {
    "qwen2": DenseArchitecture("Qwen2ForCausalLM", attention_bias=True),
    "qwen3": DenseArchitecture("Qwen3ForCausalLM", qk_norm=True),
    "llama": DenseArchitecture("LlamaForCausalLM"),
}


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (HF ``rope_scaling`` with ``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def from_hf(cls, rope_scaling: dict | None) -> Llama3RopeScaling | None:
        """None for no scaling; ValueError naming the field for a type this model lacks."""
        if not rope_scaling:
            return None
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind == "default":
            return None
        if kind != "llama3":
            raise ValueError(f"config.json rope_scaling type {kind!r} is not supported (llama3 or none)")
        try:
            return cls(
                float(rope_scaling["factor"]),
                float(rope_scaling["low_freq_factor"]),
                float(rope_scaling["high_freq_factor"]),
                int(rope_scaling["original_max_position_embeddings"]),
            )
        except KeyError as exc:
            raise ValueError(f"config.json rope_scaling (llama3) lacks {exc.args[0]!r}") from None


def rope_inv_freq(dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies of the rotary embedding [dim / 2], float32, with Llama 3 scaling as in
    HF transformers' ``_compute_llama3_parameters``: wavelengths shorter than
    ``original / high_freq_factor`` kept, longer than ``original / low_freq_factor`` divided by
    ``factor``, a linear blend in between."""
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    original = scaling.original_max_position_embeddings
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > original / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= original / scaling.high_freq_factor) & (wavelen <= original / scaling.low_freq_factor)
    return np.where(medium, blended, scaled).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    architecture: str  # "qwen2", "qwen3" or "llama"
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
    rope_scaling: Llama3RopeScaling | None = None

    @property
    def attention_bias(self) -> bool:
        return ARCHITECTURES[self.architecture].attention_bias

    @property
    def qk_norm(self) -> bool:
        return ARCHITECTURES[self.architecture].qk_norm

    def feed_forward(self, layer: int) -> nn.Module:
        """Decoder layer ``layer``'s feed-forward block, built inside that layer as "mlp"."""
        return MLP(self, name="mlp")

    def routing_index(self, layer: int) -> int | None:
        """Where layer ``layer``'s experts sit in ``routed_experts``' layer axis (None: dense)."""
        return None

    @property
    def routed_per_token(self) -> int:
        """Experts each token goes to in an MoE layer (``routed_experts``' last axis); 0: dense."""
        return 0

    @classmethod
    def from_hf(cls, source: str | Path | dict, dtype: str = "float32") -> DecoderConfig:
        """From an HF ``config.json`` (a model dir, the file, or its parsed dict); a key it omits
        takes transformers' default (``models.hf_config``), as the engine's does."""
        source = with_hf_defaults(read_hf_config(source))
        model_type = source.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(f"model_type {model_type!r} is not supported ({', '.join(ARCHITECTURES)})")
        features = ARCHITECTURES[model_type]
        if (source.get("attention_bias") and not features.attention_bias) or source.get("mlp_bias"):
            raise ValueError(f"config.json: {model_type} with attention_bias or mlp_bias is not supported")
        heads = source["num_attention_heads"]
        return cls(
            architecture=model_type,
            vocab_size=source["vocab_size"],
            hidden_size=source["hidden_size"],
            intermediate_size=source["intermediate_size"],
            num_hidden_layers=source["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=source.get("num_key_value_heads") or heads,
            head_dim=source.get("head_dim") or source["hidden_size"] // heads,
            rope_theta=float(source["rope_theta"]),
            rms_norm_eps=float(source["rms_norm_eps"]),
            tie_word_embeddings=bool(source["tie_word_embeddings"]),
            dtype=dtype,
            rope_scaling=Llama3RopeScaling.from_hf(source.get("rope_scaling")),
        )


def read_hf_config(source: str | Path | dict) -> dict:
    """An HF ``config.json`` as a dict, from a model dir, the file, or the dict itself."""
    if isinstance(source, dict):
        return source
    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    return json.loads(path.read_text())


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * scale.astype(jnp.float32)).astype(self.dtype)


def apply_rope(x, positions, theta: float, scaling: Llama3RopeScaling | None = None):
    """Rotary embedding, rotate-half (NeoX) convention as in HF Qwen and Llama. x: [B, T, heads, D]."""
    dim = x.shape[-1]
    inv_freq = jnp.asarray(rope_inv_freq(dim, theta, scaling))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(jnp.concatenate([freqs, freqs], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([freqs, freqs], -1))[:, :, None, :]
    x32 = x.astype(jnp.float32)
    half = dim // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


class Attention(nn.Module):
    config: DecoderConfig

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
        q = apply_rope(q, positions, c.rope_theta, c.rope_scaling)
        k = apply_rope(k, positions, c.rope_theta, c.rope_scaling)
        groups = c.num_attention_heads // c.num_key_value_heads
        k = jnp.repeat(k, groups, axis=2)
        v = jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(c.head_dim)
        scores = jnp.where(mask[:, None, :, :], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, -1)
        return dense(c.hidden_size, use_bias=False, name="o_proj")(out)


class MLP(nn.Module):
    config: DecoderConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        dense = partial(nn.Dense, use_bias=False, dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.dtype))
        gate = dense(c.intermediate_size, name="gate_proj")(x)
        up = dense(c.intermediate_size, name="up_proj")(x)
        return dense(c.hidden_size, name="down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    config: DecoderConfig
    layer: int = 0

    @nn.compact
    def __call__(self, x, positions, mask, routed_experts=None):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        h = RMSNorm(c.rms_norm_eps, dtype, name="input_layernorm")(x)
        x = x + Attention(c, name="self_attn")(h, positions, mask)
        h = RMSNorm(c.rms_norm_eps, dtype, name="post_attention_layernorm")(x)
        slot = c.routing_index(self.layer)
        if routed_experts is None or slot is None:
            return x + c.feed_forward(self.layer)(h)
        return x + c.feed_forward(self.layer)(h, routed_experts[:, :, slot])


class Decoder(nn.Module):
    config: DecoderConfig

    def setup(self):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype)
        self.layers = [DecoderLayer(c, layer=i) for i in range(c.num_hidden_layers)]  # named layers_{i}
        self.norm = RMSNorm(c.rms_norm_eps, dtype)

    def __call__(self, tokens, positions, mask, routed_experts=None):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, positions, mask, routed_experts)
        return self.norm(x)

    def attend(self, hidden):
        dtype = jnp.dtype(self.config.dtype)
        return table_logits(hidden.astype(dtype), self.embed_tokens.embedding.astype(dtype))


class UntiedHead(nn.Module):
    """``nn.Dense(vocab, use_bias=False)``'s parameter (``kernel`` [H, V], same init) with
    float32 logits, as :func:`table_logits` computes them for a tied head."""

    vocab_size: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, hidden):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (hidden.shape[-1], self.vocab_size), self.dtype)
        contract = (((hidden.ndim - 1,), (0,)), ((), ()))
        return jax.lax.dot_general(
            hidden.astype(self.dtype), kernel.astype(self.dtype), contract, preferred_element_type=jnp.float32
        )


class CausalLM(nn.Module):
    """``apply({'params': params}, tokens, attention_mask)`` -> logits [B, T, V] (float32).

    Mixture-of-experts models take ``routed_experts`` [B, T, MoE layers, top_k]
    (``RolloutBatch.routed_experts``): each token goes to those experts, not to its router's
    top-k, where they are given (>= 0) - rollout routing replay. Their shape is checked; ids
    past ``num_experts`` are not (the call is traced) and give NaN logits.
    """

    config: DecoderConfig

    def setup(self):
        c = self.config
        self.model = Decoder(c)
        if not c.tie_word_embeddings:
            dtype = jnp.dtype(c.dtype)
            self.lm_head = UntiedHead(c.vocab_size, dtype)

    def __call__(self, tokens, attention_mask=None, positions=None, routed_experts=None):
        return self.logits(self.hidden_states(tokens, attention_mask, positions, routed_experts))

    def hidden_states(self, tokens, attention_mask=None, positions=None, routed_experts=None):
        """The final-norm hidden states [B, T, H] the logits are read from (a value head reads them too)."""
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, dtype=bool)
        attention_mask = attention_mask.astype(bool)
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
        length = tokens.shape[1]
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))
        mask = causal[None, :, :] & attention_mask[:, None, :]
        if routed_experts is not None:
            c = self.config
            moe_layers = sum(c.routing_index(i) is not None for i in range(c.num_hidden_layers))
            expected = (*tokens.shape, moe_layers, c.routed_per_token)
            if tuple(routed_experts.shape) != expected:  # a narrower top_k would broadcast
                raise ValueError(
                    f"routed_experts has shape {tuple(routed_experts.shape)}; this model takes {expected} "
                    f"([B, T, MoE layers, top_k]) for tokens {tokens.shape}"
                )
        return self.model(tokens, positions, mask, routed_experts)

    def logits(self, hidden):
        if self.config.tie_word_embeddings:
            logits = self.model.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        return logits.astype(jnp.float32)


def greedy_decode(model: CausalLM, params, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
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
