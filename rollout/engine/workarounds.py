"""The registry of sglang-jax 0.0.2 workarounds (and two of XLA's) and their switches.

Imports nothing of this project or the engine: every engine module (patches, runtime, start-up,
handle) may ask ``workaround_enabled`` without an import circle. Each entry names the bug and
what is done about it; its pinning test is listed in ``PINNING_TESTS`` (``tests/helpers.py``).
"""

from __future__ import annotations

import os

WORKAROUNDS: dict[str, str] = {
    "duplicate-pytree-registration": (
        "layers/attention/native_backend.py registers NativeAttention as a pytree although nnx "
        "already registers every Module subclass: importing it raises 'Duplicate custom "
        "PyTreeDef type registration'. It is imported here with the duplicate registration "
        "skipped."
    ),
    "process-kill-on-error": (
        "An exception in the scheduler or detokenizer thread, a failed scheduler start, or the "
        "watchdog sends SIGQUIT, whose handler kills the whole process tree (and the watchdog "
        "signals the parent process). Engine.shutdown kills every child process of the caller. "
        "Here the threads run under guards that record the error and fail the waiting caller "
        "with EngineError; no signal handler is installed and shutdown is done by hand."
    ),
    "idle-busy-spin": (
        "The idle scheduler loop polls its sockets without blocking: one core at 100%. The "
        "loop now blocks in a zmq poll while idle, woken by requests or queued calls."
    ),
    "whole-batch-admission": (
        "The tokenizer manager sends a call's requests to the scheduler one by one, and the "
        "scheduler admits whatever has arrived when it wakes: on a loaded host one call's rows "
        "were split over several prefills (more forwards, and batch shapes a warmed engine had "
        "never compiled: a warmed generate compiled 4 programs). The request loop registers a "
        "call's request ids before sending it, and the scheduler, once part of a call has "
        "arrived, waits for the rest (runtime.BatchArrivals)."
    ),
    "process-global-side-effects": (
        "Engine start-up forces the root logger to its level (basicConfig(force=True)), reseeds "
        "numpy and random, installs uvloop's event-loop policy, SIGCHLD/SIGQUIT/SIGTERM "
        "handlers and an atexit hook, disables the multiprocessing resource tracker, and "
        "disables threading's atexit registration. Each is prevented or undone."
    ),
    "untied-head-dtype": (
        "Untied models (tie_word_embeddings false) create lm_head with the default param dtype "
        "bfloat16 and compute logits in it whatever the model dtype. The head's dtype and "
        "weight are set to the model dtype as the model is loaded, before its forward is jitted and "
        "precompiled."
    ),
    "detokenizer-output-ids": (
        "With a tokenizer loaded, the detokenizer path returns output_ids that silently drop "
        "special tokens (EOS mid-sequence under ignore_eos, a matched stop token), so "
        "len(output_ids) < completion_tokens. The engine always runs with skip_tokenizer_init "
        "and exact token ids; the worker encodes prompts and decodes completions itself."
    ),
    "shared-hf-config": (
        "hf_transformers_utils.get_config caches the HF config object per model path, and "
        "ModelConfig.configure_for_tensor_parallel mutates it (KV heads replicated for tp): a "
        "second engine on the same model dir in one process starts from the mutated config "
        "and crashes in its first forward ('Incompatible shapes for broadcasting'). The cache "
        "is cleared before every engine start."
    ),
    "one-request-per-sample": (
        "GenerateReqInput ignores n > 1 for a single prompt, and batched n first runs a "
        "prefix-caching request per prompt, waiting for each in turn (one prefill step per "
        "prompt). Every sample is sent as its own "
        "request with its own seed (RequestLoop._request), after one prompt-only request per "
        "prompt that puts it in the prefix cache (RequestLoop._cache_prompts): the samples "
        "then prefill only their last token (page), as the engine's own n meant to."
    ),
    "flush-cache": (
        "Engine.flush_cache and release/resume_memory_occupation raise TypeError and the "
        "scheduler has no handler for them. Cache flush and KV drop/rebuild are done directly "
        "on the scheduler thread."
    ),
    "engine-devices": (
        "The Scheduler builds its mesh over every jax.devices() (a data axis of "
        "devices / tp_size), so engines cannot be placed on device subsets. With "
        "EngineOptions.devices the mesh is exactly those devices, in that order, and the "
        "engine starts and runs with the first of them as JAX's default device, so arrays it "
        "creates without a sharding (the model's and the sampler's rng state) stay on its "
        "devices."
    ),
    "device-memory-scope": (
        "ModelRunner measures free device memory as the minimum over every local device, "
        "calling jax.clear_caches() first on TPU and GPU: starting an engine drops every "
        "compiled function in the process (the other engines' forwards, the trainer's step), "
        "and an engine's KV budget is capped by what other engines use on other devices. It "
        "is measured on the engine's own devices, without clearing caches."
    ),
    "concurrent-start-up": (
        "Engine start-up saves and restores process state (preserved_process_state), clears "
        "and then mutates the cached HF config (shared-hf-config), and updates the module "
        "global server-args dict: engines started from several threads at once would "
        "interleave these. Start-ups are serialized by a process-wide lock, held until the "
        "engine's own threads have registered (they learn from it which engine they serve)."
    ),
    "failed-start-sockets": (
        "A start-up that fails (e.g. 'Not enough memory' when free RAM shrinks between the "
        "engine's two measurements) leaves the zmq sockets the half-built scheduler opened; "
        "their contexts then block interpreter exit for good (zmq_ctx_term waits on open "
        "sockets) while the exception's traceback is kept, as pytest keeps it. The sockets "
        "opened during a start-up are recorded and closed if it fails."
    ),
    "gpu-matmul-precision": (
        "On GPU, ModelRunner sets jax_default_matmul_precision='highest' process-wide, "
        "changing the trainer's matmuls too. The process-wide value is restored after "
        "start-up and the engine's scheduler thread runs under the value it set."
    ),
    "bf16-matmul-precision": (
        "0.0.2 sets 'highest' matmul precision on GPU for every model, where it keeps float32 "
        "weights' dots out of TF32; with bfloat16 weights it buys no accuracy (a bf16 product is "
        "exact in float32) and costs time: on an H200 a Qwen2.5-1.5B decode step's bf16 matmuls "
        "took x1.14-1.15 as long under it (jax 0.11.2). For 16-bit weights, ModelRunner.initialize "
        "puts back the precision the process had, before the precompile and the scheduler "
        "thread (which would otherwise compile every shape again); a float32 engine keeps "
        "'highest'."
    ),
    "gpu-dot-merger": (
        "Not sglang-jax's: XLA's GPU backend merges dots that share an operand into one dot "
        "(its DotMerger pass, for dots under a size threshold, 32 MB by default), so the model's "
        "separate gate and up projections (and q, k, v) become one dot over their weights "
        "concatenated at run time. Where cuBLAS runs that dot (Triton's GEMMs off, as they had to "
        "be on an H200 whose autotuner crashed, docs/benchmarks.md) the concatenation is a copy "
        "of those weights every layer of every forward: 27 us a layer at the Qwen2.5-1.5B shape "
        "(jax 0.11.2, 64-row decode chunks), 12.3 of a chunk's 58.6 ms of kernels. With Triton's "
        "GEMMs XLA fuses it into the GEMM. On a GPU the engine's forward and the decode chunks "
        "are compiled with xla_gpu_dot_merger_threshold_mb=0 (programs.engine_compiler_options): "
        "the two dots read the same bytes as the merged one."
    ),
    "sampler": (
        "0.0.2's sampler is wrong in four ways. Off TPU, _apply_min_p_filter receives 3 operands "
        "and unpacks 2 (lax.cond traces it even for greedy decoding, so every sampled request "
        "crashes). Its RNG state is frozen inside a functools.partial, so temperature sampling "
        "repeats itself every step and call, and its own seeded path uses a weak integer hash "
        "and, off TPU, a softmax of probabilities that flattens the distribution. "
        "return_logprob=True (and top_logprobs_num) crashes the scheduler thread (log-probs "
        "stored on a traced copy inside jit), and they would be of the unfiltered distribution "
        "anyway. And it filters differently per backend (top-k/top-p before the temperature on "
        "TPU, after it elsewhere through a host callback; min-p on logits on TPU). "
        "Sampler.__call__ is replaced by one that applies temperature, top-k, top-p and min-p "
        "the same way on every backend (models/logprobs.py, shared with the trainer), draws "
        "each token by inverse CDF (draw.py: one uniform per row, not the Gumbel noise per "
        "vocabulary entry of jax.random.categorical) at a uniform keyed by (request seed, "
        "position) (fresh samples per call, the same samples for the same seed, whatever the "
        "batch), and returns its log-prob with it, always. ModelRunner.sample runs one program "
        "per draw a batch needs (all greedy, sampled, some row filtering), named on the host "
        "from the batch's parameters, so each batch size compiles only what its batches use; "
        "the precompile compiles all three. Requests that ask for log-probs get them on the "
        "scheduler thread, fetched in the same device_get as the token ids."
    ),
    "flax-eager-sharding": (
        "With flax >= 0.12.1 (flax.config.flax_always_shard_variable, default on) every "
        "nnx.Variable created with a sharding annotation is sharded at creation, which needs a "
        "mesh context 0.0.2 does not set up: model creation fails with 'An auto mesh context or "
        "metadata is required'. The flag is turned off while the engine builds or reloads its "
        "model and restored afterwards (the weights get their shardings from the loader's "
        "jit out_shardings either way), so the trainer's own models keep flax's default."
    ),
    "failure-signal-handler": (
        "ModelRunner._forward and the sampling step import jax._src.test_util on every forward; "
        "its first import installs absl's failure signal handler for SIGTERM (among others) in "
        "place of the process's own, so a SIGTERM after the first request dumps a stack trace "
        "and aborts the process (exit 134) instead of reaching Python's handler (a server's "
        "drain). It is imported once when the workarounds are installed, with the process's "
        "SIGTERM handler saved and put back."
    ),
    "native-attention-memory": (
        "The native attention backend (the one used off TPU) gathers every slot of cache_loc, "
        "which is padded to max_running_requests x context_length, and builds logits against "
        "all of them for every token: a prefill chunk of a real model config asks for hundreds "
        "of GB, and decode is slow. It also locates requests in cache_loc without the page "
        "rounding the scheduler uses, so page_size > 1 attends to the wrong slots. Replaced by "
        "attention.paged_attention: each query block walks only its own requests' slots in "
        "fixed chunks with an online softmax (memory ~ tokens x chunk), same results."
    ),
    "llama3-rope-scaling": (
        "Llama3RotaryEmbedding (rope_scaling rope_type 'llama3', Llama 3.1-3.3) overrides "
        "_compute_inv_freq, but RotaryEmbedding.__call__ reads the unscaled frequencies its "
        "__init__ computed: the scaling is silently ignored and every position past a few "
        "tokens differs from HF transformers and the trainer. The scaled frequencies are "
        "computed once when the embedding is built."
    ),
    "head-dim-padding": (
        "The safetensors WeightLoader pads head_dim up to a multiple of 128 (q/k/v/o weights "
        "and biases) but the model code keeps the config's head_dim: a model with head_dim 64 "
        "(Qwen2.5-0.5B, Llama 3.2-1B) boots with load_format='auto' and its first generate "
        "kills the engine ('Incompatible shapes for broadcasting: (256, 4, 64) and requested "
        "shape (128, 4, 64)'). The loader keeps the config's head_dim (the TPU attention "
        "kernel pads to 128 lanes by itself)."
    ),
    "moe-forward": (
        "The mixture-of-experts block (layers/moe.py EPMoE) is wrong in three ways. With one "
        "expert shard (tp_size 1) every forward raises TypeError: _single_device_forward is "
        "defined twice and the router-logit variant is shadowed. With several, the expert "
        "matmuls are megablox's TPU-only Pallas kernel and ragged_all_to_all, which do not run "
        "off TPU. And the routing weights are a bfloat16 softmax of the top-k logits whatever "
        "the model dtype, always renormalized (norm_topk_prob ignored). Replaced by "
        "moe.routed_experts: HF's float32 routing (models/moe.py, shared with the trainer), "
        "each device running its own experts on the tokens routed to them with "
        "jax.lax.ragged_dot, partial sums added across devices."
    ),
    "moe-jax-import": (
        "models/qwen3_moe.py does 'from jax import jax', which jax 0.10 and later no longer "
        "allow: the model registry skips the module with a warning and Qwen3-MoE engines cannot "
        "start ('Model architectures [...] are not supported'). It is imported with jax.jax set "
        "for the duration and registered. Always on (up to jax 0.9 it changes nothing)."
    ),
    "moe-expert-shapes": (
        "EPMoE creates its stacked expert weights with num_experts / expert_shards experts, "
        "the per-device count used as the global shape: a dummy-loaded engine with tp_size > 1 "
        "holds too few experts (the safetensors loader replaces them with full stacks, so only "
        "load_format='dummy' shows it) and syncs of the trainer's [E, ...] stacks fail. They are "
        "created with all num_experts, sharded over the expert shards."
    ),
    "moe-sparse-step": (
        "Qwen3-MoE's decoder_sparse_step is ignored: every layer not in mlp_only_layers gets "
        "experts, where HF transformers makes every layer whose (index + 1) is not a multiple "
        "of the step dense; the loader then finds no expert tensors for those layers and "
        "leaves them random (a warning only). The model is built with every dense layer listed "
        "in mlp_only_layers."
    ),
    "bf16-logits": (
        "LogitsProcessor._get_logits computes the logits in the model's dtype: a bfloat16 engine "
        "rounds every logit to 8 significant bits (steps of 0.125 at a logit of 20) before the "
        "sampler and the reported log-probs, where the trainer's are float32; and XLA's CPU "
        "backend runs that bfloat16-output dot against the table's transpose 5-8x slower than "
        "one with float32 output (the LM head was 89% of a Qwen2.5-0.5B decode step). Logits "
        "are computed as the trainer computes them (models.table_logits: float32 accumulation "
        "and output)."
    ),
    "kv-pool-conversions": (
        "The native backend writes each layer's new K/V into the pool with a bf16 scatter "
        "(set_kv_buffer_legacy); XLA's CPU backend computes bf16 scatters in f32, so every "
        "forward converts each layer's whole KV pool to f32 and back (passes over "
        "max_total_tokens slots per layer, whatever the batch; XLA in jax 0.8, fixed by 0.12). "
        "With native-attention-memory, where a probe finds XLA converting (converts_16bit_rows), "
        "the write and the attention's reads go through a same-width integer view of the pool "
        "(attention.set_rows / take_rows): bit-identical, no f32 copy (one integer copy of the "
        "pool remains: XLA 0.8 copies for the view)."
    ),
    "tpu-kernel-jax-names": (
        "The TPU kernels (flash_attn_kernel's ragged paged attention, memory_pool's fused KV "
        "write) use pltpu.ANY, pltpu.TPUMemorySpace and jax._src.dtypes.bit_width, which jax "
        "0.12 no longer has: on a TPU at jax 0.12 the 'fa' attention backend and the KV write "
        "raise AttributeError as they are traced. The kernel modules get namespaces adding the "
        "old names (pl.ANY, pltpu.MemorySpace, dtypes.itemsize_bits); JAX is left as it is. "
        "Always on (at jax 0.8 it changes nothing)."
    ),
    "retracted-admission": (
        "PrefillAdder.add_one_req budgets a request's input plus its whole max_new_tokens; for "
        "a request retracted for memory the input already holds the tokens it sampled, so one "
        "retracted late in a tight KV pool never fit again and waited forever (generate never "
        "returned). Its admission counts max_new_tokens less what it sampled "
        "(rollout/engine/scheduling.py)."
    ),
    "stop-ids-with-ignore-eos": (
        "Req.check_finished tests the stop token ids only without ignore_eos: a call with stop "
        "ids and ignore_eos ran to max_new_tokens. They are tested with ignore_eos too (the "
        "worker adds the model's EOS ids to them only without it)."
    ),
    "abandoned-row-tasks": (
        "TokenizerManager._handle_batch_request waits for each row of a streamed call in a task "
        "of its own and leaves them when its consumer stops; a row that had ended ends its task "
        "with StopAsyncIteration, logged at ERROR ('Task exception was never retrieved') after "
        "ordinary server streams whose choices reached stop strings. The engine's request loop "
        "does not log that exception."
    ),
    "retracted-cached-tokens": (
        "Req.cached_tokens adds the prefix a request finds cached at every prefill, and a request "
        "retracted under memory pressure is prefilled again: its count doubled (37 cached tokens "
        "of a 19-token prompt), as did the server's usage.prompt_tokens_details.cached_tokens. "
        "A row reports what its first prefill found cached."
    ),
    "eos-token-id-zero": (
        "ModelConfig.get_hf_eos_token_id tests the config's eos_token_id for truth: an EOS id of 0 "
        "stays the int 0, which a generation_config.json's EOS ids then cannot be added to "
        "(TypeError at start-up), and without one the scheduler's 'token in eos_token_ids' "
        "fails on the first token. The ids are read as a set whatever their value."
    ),
    "aborted-queued-state": (
        "TokenizerManager._handle_abort_req, which answers the abort of a request still in the "
        "scheduler's queue, marks its state finished but never deletes it from rid_to_state, as "
        "an ended request's is: each call cancelled before its rows were admitted (a client gone "
        "at once) left them there for the engine's life. It is deleted there."
    ),
    "stop-token-at-length": (
        "Req.check_finished tests the length before the stop ids: a completion whose last "
        "allowed token is a stop token (its EOS) ended as 'length', which a trainer that "
        "penalizes truncation penalized. It ends as 'stop'."
    ),
    "xla-stale-packed-weights": (
        "Not sglang-jax's: XLA's CPU backend in jaxlib 0.8 packs the weight operand of an f32 "
        "dot for XNNPACK once and reuses it while the buffer's address stays the same, so a "
        "weight rewritten in place (the params a train step donates, which the engine serves "
        "zero-copy) is read as its old values by every function that packed it. import rollout "
        "adds --xla_cpu_use_xnnpack=false to XLA_FLAGS on those releases "
        "(rollout/in_place_updates.py), and a worker refuses to start where a probe still "
        "reads the old values."
    ),
}

# Switches workarounds off for a process, to check whether a newer sglang-jax still needs one:
# ROLLOUT_DISABLE_WORKAROUNDS=sampler,flush-cache. The pinning test of each must then
# fail (tests/test_engine_workarounds.py checks that it does, in a subprocess per workaround).
DISABLE_ENV = "ROLLOUT_DISABLE_WORKAROUNDS"


def disabled_workarounds() -> frozenset[str]:
    """The workarounds that ``ROLLOUT_DISABLE_WORKAROUNDS`` (comma-separated names) switches off."""
    names = {name.strip() for name in os.environ.get(DISABLE_ENV, "").split(",") if name.strip()}
    unknown = sorted(names - set(WORKAROUNDS))
    if unknown:
        raise ValueError(f"{DISABLE_ENV} names unknown workaround(s) {unknown}; known: {sorted(WORKAROUNDS)}")
    return frozenset(names)


def workaround_enabled(name: str) -> bool:
    if name not in WORKAROUNDS:
        raise KeyError(f"no workaround named {name!r}")
    return name not in disabled_workarounds()
