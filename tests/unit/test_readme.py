"""The guide (README.md, docs/*.md): every marked code block has a plan, and the quick ones run here."""

import pytest

from tests.helpers import block_code, readme_blocks, source_name

# The guide's text does not change with the JAX version: one end (the newest) runs its blocks (the
# calls they make are tested at both ends by the rest of the suite).
pytestmark = pytest.mark.one_end


# Blocks this test does not run, and why. Every other block has a test in tests/test_readme.py or below.
SKIPPED = {
    "start": "`make test` is this suite, and `make demo` runs the example tests/test_grpo.py runs (30 steps)",
    "serve-tpu": "needs 4 TPU chips; serve-cpu runs the same command on CPU devices",
    "grpo-tpu": (
        "TPU and network (downloads Qwen2.5-3B and GSM8K); tests/test_grpo.py runs the preset on a local stand-in"
    ),
    "pods-leave": (
        "tests/test_pods.py runs this path: a peer SIGKILLed mid-sync, the survivor handles its PodError, "
        "closes and leaves (exit 0)"
    ),
    "install": "installs into another environment; `make test` installs both of its venvs the same way",
    "bench": "the benchmarks take tens of minutes and print figures, not pass/fail; the suite tests what they call",
}
RUN = {"use", "logprobs", "routing-replay", "episodes", "serve-cpu", "client", "admin", "tiny-models", "pods"}


def test_every_block_has_a_plan():
    blocks = readme_blocks()
    assert not set(SKIPPED) & RUN
    assert set(blocks) == set(SKIPPED) | RUN, (
        f"blocks without a plan here: {sorted(set(blocks) - set(SKIPPED) - RUN)}; "
        f"plans without a block: {sorted((set(SKIPPED) | RUN) - set(blocks))}"
    )


def test_tiny_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(block_code("tiny-models"), source_name("tiny-models"), "exec"), {})
    written = sorted(p.parent.name for p in tmp_path.glob("tiny/*/config.json"))
    assert written == ["llama3", "qwen2", "qwen3", "qwen3-moe", "random-llama"]
    assert all((tmp_path / "tiny" / name / "tokenizer.json").exists() for name in written)
    # The server's and the episodes' blocks take tiny/qwen2: their chat needs a template.
    assert "chat_template" in (tmp_path / "tiny" / "qwen2" / "tokenizer_config.json").read_text()
