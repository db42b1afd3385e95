"""The reference a user compares with first: Hugging Face transformers' ``generate`` on PyTorch.

    python bench/torch_generate.py MODEL_DIR --prompts 16 --prompt-tokens 64 --n 4 --new-tokens 64

Runs under any Python with torch and transformers (``bench.generate_bench --torch-python``
starts it in such an environment; it imports nothing of this project). Same batch as the
bench's decode-heavy one: random prompt ids (numpy seed 0), n samples per prompt, temperature
1, no EOS stop, bfloat16. Prints one JSON line: the median seconds of ``repeats`` calls after a
warm-up, and torch's thread count.
"""

import argparse
import json
import statistics
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size
    prompts = np.random.default_rng(0).integers(1, vocab, (args.prompts, args.prompt_tokens))
    ids = torch.as_tensor(np.repeat(prompts, args.n, axis=0))

    def run(new_tokens: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
            )
        assert out.shape[1] == args.prompt_tokens + new_tokens
        return time.perf_counter() - start

    run(2)
    seconds = statistics.median(run(args.new_tokens) for _ in range(args.repeats))
    print(json.dumps({"seconds": seconds, "threads": torch.get_num_threads(), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
