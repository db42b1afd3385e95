"""Tiny random Qwen2 / Qwen3 / Llama model directories, built locally with no network.

A directory holds what a Hugging Face checkpoint holds: ``config.json``, ``model.safetensors``
with HF key names and [out, in] linear weights, and a tokenizer (``tokenizer.json`` plus
``tokenizer_config.json``) trained here with ``tokenizers``. Tests, examples and benchmarks
use these in place of hub downloads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from .decoder_flax import ARCHITECTURES

# The default head_dim: the engine's fast TPU attention kernel works in 128-lane blocks.
TINY_HEAD_DIM = 128


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAR_VOCAB = "0123456789+-*=() "

# Qwen2.5's ChatML layout with its tool calls (rollout/chat.py parses them back), in few words:
# the tiny tokenizer spends about a token per character and the tests' context is 256 tokens.
# - With ``tools``: a system turn (the system message's text first, if any) listing each tool as
#   JSON inside <tools></tools> and showing the <tool_call> block that calls one.
# - An assistant message with ``tool_calls`` (``function.arguments`` an object): its text, then one
#   <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> block per call.
# - ``tool`` messages: <tool_response> blocks, consecutive ones in one user turn.
# Other messages render as plain ChatML: without tools and tool messages, exactly as before.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nTo call a tool, answer <tool_call>\\n"
    '{"name": <name>, "arguments": <args>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set function = call['function'] if call['function'] is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": ' + (function['name'] | tojson) + ', \"arguments\": ' }}"
    "{{- (function['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Text the tiny tokenizer is trained on: digits, arithmetic and a few words, enough for toy tasks.
_TOKENIZER_CORPUS = (
    [f"{a}+{b}={a + b}" for a in range(0, 100, 7) for b in range(0, 100, 11)]
    + ["the answer is", "hello world", "question: answer:", "copy: reverse: sum:"]
    + [" ".join(str(d) for d in range(k, k + 10)) for k in range(10)]
)


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny model. Defaults give a 2-layer GQA Qwen2 with biases and tied embeddings."""

    architecture: str = "qwen2"  # "qwen2", "qwen3" or "llama"
    vocab_size: int = 320
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    head_dim: int = TINY_HEAD_DIM
    # HF rope_scaling, e.g. Llama 3.1's {"rope_type": "llama3", "factor": 8.0, ...}; None: plain RoPE.
    rope_scaling: dict | None = None
    seed: int = 0
    # "bpe": byte-level BPE trained on a small corpus (needs vocab_size >= 259);
    # "chars": one token per character of CHAR_VOCAB, for toy arithmetic tasks.
    tokenizer: str = "bpe"
    # Write Qwen's ChatML template into tokenizer_config.json (chat prompts, the OpenAI chat route).
    chat_template: bool = False
    # "chars" only: characters beyond CHAR_VOCAB ("\n" for the chat template), and strings that
    # are one token each (a chat template's role names, tool-call markup), after them.
    extra_chars: str = ""
    added_tokens: tuple[str, ...] = ()

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}, got {self.architecture!r}")
        if self.tokenizer not in ("bpe", "chars"):
            raise ValueError(f"tokenizer must be 'bpe' or 'chars', got {self.tokenizer!r}")
        if (self.extra_chars or self.added_tokens) and self.tokenizer != "chars":
            raise ValueError("extra_chars and added_tokens extend the 'chars' tokenizer only")
        object.__setattr__(self, "added_tokens", tuple(self.added_tokens))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    def hf_config(self) -> dict:
        return {
            "architectures": [ARCHITECTURES[self.architecture].hf_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": ARCHITECTURES[self.architecture].attention_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": "float32",
            "bos_token_id": 0,
            "eos_token_id": 0,
            "pad_token_id": 0,
        }

    def hf_weights(self) -> dict[str, np.ndarray]:
        """The model's random weights under HF names (a subclass may add its own)."""
        return random_hf_weights(self)


def random_hf_weights(spec: TinyModelSpec) -> dict[str, np.ndarray]:
    """Random float32 weights under HF Qwen2/Qwen3/Llama key names ([out, in] linear layout).

    Scales give logits with a spread of about one unit: far from uniform, so a wrong mapping
    shows up in greedy tokens, yet temperature sampling still varies.
    """
    rng = np.random.default_rng(spec.seed)
    features = ARCHITECTURES[spec.architecture]
    hidden, inter, head_dim = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out = spec.num_attention_heads * head_dim
    kv_out = spec.num_key_value_heads * head_dim

    def linear(out_features: int, in_features: int) -> np.ndarray:
        return rng.normal(0.0, in_features**-0.5, (out_features, in_features)).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1.0 + rng.normal(0.0, 0.1, size)).astype(np.float32)

    def bias(size: int) -> np.ndarray:
        return rng.normal(0.0, 0.1, size).astype(np.float32)

    embedding = rng.normal(0.0, 0.05, (spec.vocab_size, hidden)).astype(np.float32)
    weights = {"model.embed_tokens.weight": embedding}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = linear(q_out, hidden)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_out, hidden)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_out, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_out)
        if features.attention_bias:
            weights[p + "self_attn.q_proj.bias"] = bias(q_out)
            weights[p + "self_attn.k_proj.bias"] = bias(kv_out)
            weights[p + "self_attn.v_proj.bias"] = bias(kv_out)
        if features.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
            weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
    weights["model.norm.weight"] = norm(hidden)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = linear(spec.vocab_size, hidden)
    return weights


def train_tiny_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a small built-in corpus (no network)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TOKENIZER_CORPUS, trainer=trainer)
    return tokenizer


def write_tiny_model(path: str | Path, spec: TinyModelSpec = TinyModelSpec(), *, with_tokenizer: bool = True) -> Path:
    """Write a tiny random HF model directory at ``path`` and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(spec.hf_config(), indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "pad_token_id": 0}))
    save_file(spec.hf_weights(), str(path / "model.safetensors"), metadata={"format": "pt"})
    if with_tokenizer:
        write_tiny_tokenizer(path, spec)
    return path


def char_tokenizer(extra_chars: str = "", added_tokens: tuple[str, ...] = ()):
    """One token per character of CHAR_VOCAB (and ``extra_chars``), after the special tokens;
    then each of ``added_tokens`` as one token (found in text before it is split into
    characters, and decoded as written)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(CHAR_VOCAB + extra_chars))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # newlines too
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.add_tokens(list(added_tokens))
    return tokenizer


def write_tiny_tokenizer(path: Path, spec: TinyModelSpec) -> None:
    if spec.tokenizer == "bpe":
        tokenizer = train_tiny_tokenizer(spec.vocab_size)
    else:
        tokenizer = char_tokenizer(spec.extra_chars, spec.added_tokens)
    if tokenizer.get_vocab_size() > spec.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than vocab_size={spec.vocab_size}")
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "bos_token": None,
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    if spec.chat_template:
        config["chat_template"] = CHATML_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def tiny_random_llama_spec(**overrides) -> TinyModelSpec:
    """The shapes of ``hf-internal-testing/tiny-random-LlamaForCausalLM`` (vocab 32000, hidden
    16, 2 layers, 4 heads of head_dim 4, untied), which the seeds' HTTP admin and several-engines
    runs used; its tokenizer here is the offline BPE one (fewer tokens than the vocab)."""
    settings = dict(
        architecture="llama",
        vocab_size=32000,
        hidden_size=16,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=4,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
    )
    settings.update(overrides)
    return TinyModelSpec(**settings)


def tiny_llama3_spec(**overrides) -> TinyModelSpec:
    """A Llama-3.1-style model: GQA (4 heads, 2 KV heads), head_dim 64 (as Llama 3.2-1B),
    llama3 RoPE scaling, untied head. ``original_max_position_embeddings`` is short so that the
    scaling changes the positions of a few tokens (at 8192 it would only show past thousands)."""
    settings = dict(
        architecture="llama",
        vocab_size=320,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    settings.update(overrides)
    return TinyModelSpec(**settings)
