"""The reference a user compares with first: Hugging Face transformers' ``generate`` on PyTorch.

    python bench/torch_generate.py MODEL_DIR --prompts 16 --prompt-tokens 64 --n 4 --new-tokens 64 [--compile]

Runs under any Python with torch and transformers (``bench.generate_bench --torch-python``
starts it in such an environment; it imports nothing of this project). Same batch as the
bench's decode-heavy one: random prompt ids (numpy seed 0), n samples per prompt, temperature
1, no EOS stop, bfloat16, on the GPU when torch sees one. A model dir without weights (the
bench's ``--dummy-weights``) gets a random initialisation from its config. Prints one JSON line:
the median seconds of ``repeats`` calls after a warm-up, the device, and torch's thread count.

``--compile``: the fastest path transformers offers, a static KV cache and the decoding forward
compiled with ``torch.compile`` (``mode="reduce-overhead"``: CUDA graphs on a GPU), its compile
paid by the warm-up call, which has the timed calls' shapes.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="static cache + torch.compile")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if any(Path(args.model_dir).glob("*.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    else:
        with torch.device(device):  # initialised where it runs: a 3B init takes a minute on a CPU
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_dir))
    # .to() rather than a dtype argument: transformers 4.56 renamed it (torch_dtype -> dtype).
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size
    prompts = np.random.default_rng(0).integers(1, vocab, (args.prompts, args.prompt_tokens))
    ids = torch.as_tensor(np.repeat(prompts, args.n, axis=0), device=device)

    compiled = {}
    if args.compile:
        from transformers import CompileConfig

        compiled = dict(
            cache_implementation="static",
            compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"),
        )

    def run(new_tokens: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
                **compiled,
            )
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == args.prompt_tokens + new_tokens
        return time.perf_counter() - start

    # A static cache is sized by the call's length: the warm-up compiles at the timed shapes.
    run(args.new_tokens if args.compile else 2)
    seconds = statistics.median(run(args.new_tokens) for _ in range(args.repeats))
    print(
        json.dumps(
            {
                "seconds": seconds,
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "mode": "static cache + torch.compile" if args.compile else "dynamic cache, eager",
                # generate compiles its decoding forward only where it can (CUDA, a static cache).
                "compiled": getattr(model, "_compiled_call", None) is not None,
            }
        )
    )


if __name__ == "__main__":
    main()
