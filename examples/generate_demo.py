"""Smallest real generation: a tiny random Qwen2 built locally, served in-process by sglang-jax.

python -m examples.generate_demo
"""

import dataclasses
import logging
import tempfile

from models import TinyModelSpec, write_tiny_model
from rollout import RolloutWorker, WorkerConfig


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    prompts: tuple[str, ...] = ("12+34=", "hello world", "the answer is")
    samples_per_prompt: int = 2
    max_new_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0


def main(config: DemoConfig) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log = logging.getLogger("demo")
    log.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(tmp, TinyModelSpec(seed=config.seed))
        worker_config = WorkerConfig(
            model_path=str(model_dir), dtype="float32", max_total_tokens=2048, context_length=256
        )
        with RolloutWorker(worker_config) as worker:
            batch = worker.generate(
                list(config.prompts),
                n=config.samples_per_prompt,
                temperature=config.temperature,
                max_new_tokens=config.max_new_tokens,
                seed=config.seed,
            )
    for row, text in enumerate(batch.completion_texts):
        prompt = config.prompts[batch.prompt_index[row]]
        log.info("%r -> %r (%d tokens, %s)", prompt, text, len(batch.completions[row]), batch.finish_reasons[row])


if __name__ == "__main__":
    main(DemoConfig())
