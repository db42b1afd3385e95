"""Every code block of the README runs as written, so the guide stays true.

Each block is preceded by ``<!-- readme-block: ID -->`` and has a plan here: run it (Python in
this process or under the local pod launcher, shell with bash), or skip it with the reason. Lines
marked ``# placeholder`` are the reader's to fill: the test drops them and supplies the names
they define (a tiny model, a param tree, a stand-in train step). The other changes a plan makes
are listed with it (a free port for the README's 8000).
"""

import functools
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import pytest

from models import write_tiny_model
from models.tiny import tiny_llama3_spec
from trainer_bridge import load_hf_params

# The README's text does not change with the JAX version: the oldest end runs its blocks (the
# calls they make are tested at both ends by the rest of the suite).
pytestmark = pytest.mark.one_end

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BLOCK = re.compile(r"<!-- readme-block: (?P<id>[\w-]+) -->\n```(?P<language>\w+)\n(?P<code>.*?)^```", re.S | re.M)
PLACEHOLDER = "# placeholder"


def readme_blocks() -> dict[str, tuple[str, str]]:
    return {m["id"]: (m["language"], m["code"]) for m in BLOCK.finditer(README.read_text())}


# Blocks this test does not run, and why. Every other block has a test below.
SKIPPED = {
    "start": "`make test` is this suite, and `make demo` runs the example tests/test_grpo.py runs (30 steps)",
    "serve-tpu": "needs 4 TPU chips; serve-cpu runs the same command on CPU devices",
    "grpo-tpu": "TPU and network (downloads Qwen2.5-3B and GSM8K); tests/test_grpo.py runs the preset on a local stand-in",
    "pods-leave": "tests/test_pods.py runs this path: a peer SIGKILLed mid-sync, the survivor handles its PodError, closes and leaves (exit 0)",
    "install": "installs into another environment; `make test` installs both of its venvs the same way",
}
RUN = {"use", "logprobs", "serve-cpu", "client", "admin", "tiny-models", "pods"}


def test_every_block_has_a_plan():
    blocks = readme_blocks()
    fences = README.read_text().count("\n```") // 2
    assert len(blocks) == fences, "every fenced block needs a <!-- readme-block: ID --> line before it"
    assert set(blocks) == set(SKIPPED) | RUN, "a block without a plan here, or a plan without its block"


def without_placeholders(code: str, supplied, definitions: str = "") -> str:
    """The block with its placeholder lines replaced by ``definitions`` (at the first of them);
    the names they define must be exactly ``supplied``."""
    kept, defined = [], set()
    for line in code.splitlines():
        if PLACEHOLDER in line:
            if not defined:
                kept.append(definitions)
            defined |= {name.strip() for name in line.split("=")[0].split(",")}
        else:
            kept.append(line)
    assert defined == set(supplied), f"placeholders {sorted(defined)}, supplied {sorted(supplied)}"
    return "\n".join(kept) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- Python blocks in this process ------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """4 heads, 2 KV heads: the Use block's tp_size=4 runs on the suite's 4 CPU devices."""
    return write_tiny_model(tmp_path_factory.mktemp("readme-llama"), tiny_llama3_spec(seed=31))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _update(params, opt_state, tokens):
    return jax.tree_util.tree_map(lambda x: x * 0.999, params), opt_state + tokens.shape[0]


def _train_step(params, opt_state, batch):
    """A stand-in train step: donates params and optimizer state, as a real one does."""
    return _update(params, opt_state, batch.tokens)


def run_python(block: str, supplied: dict) -> dict:
    namespace = dict(supplied)
    exec(compile(without_placeholders(readme_blocks()[block][1], supplied), f"README.md:{block}", "exec"), namespace)
    return namespace


def test_use(llama_dir):
    params = load_hf_params(llama_dir)
    namespace = run_python(
        "use", dict(model_dir=str(llama_dir), params=params, opt_state=jnp.zeros(()), train_step=_train_step,
                    prompts=["1+2=", "7+5="]),
    )
    batch, report = namespace["batch"], namespace["report"]
    assert batch.tokens.shape == (2 * 8, 256 + 256) and report.version == 1
    assert int(namespace["opt_state"]) == 16  # the train step ran


def test_logprobs(qwen2_dir):
    from rollout import RolloutWorker
    from tests.helpers import tiny_worker_config

    params = load_hf_params(qwen2_dir)
    with RolloutWorker(tiny_worker_config(qwen2_dir, load_format="dummy", context_length=512)) as worker:
        worker.sync_params(params)
        namespace = run_python("logprobs", dict(worker=worker, params=params, prompts=["1+2=", "7+5="]))
    assert namespace["report"].max_abs_diff < 1e-3 and namespace["batch"].logprobs.shape == namespace["batch"].tokens.shape


# ---- the server, its client and its admin routes --------------------------------------------


@pytest.fixture(scope="module")
def served(chat_dir):
    """serve-cpu as written, on a free port instead of 8000 and the session's chat model."""
    port = free_port()
    command = readme_blocks()["serve-cpu"][1].replace("--port 8000", f"--port {port}")
    # `python` is this environment's, as for a reader who activated it.
    env = dict(os.environ, MODEL_DIR=str(chat_dir), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("XLA_FLAGS", None)
    process = subprocess.Popen(["bash", "-c", command], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the README's server did not get ready in 240 s"
            try:
                if httpx.get(url + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)  # polls the server's own readiness route
        yield port
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_client(served, capsys):
    code = readme_blocks()["client"][1].replace("127.0.0.1:8000", f"127.0.0.1:{served}")
    exec(compile(code, "README.md:client", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip()


def test_admin(served):
    code = readme_blocks()["admin"][1].replace("127.0.0.1:8000", f"127.0.0.1:{served}")
    result = subprocess.run(
        ["bash", "-e", "-c", code], env=dict(os.environ, ROLLOUT_ADMIN_TOKEN="secret"), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    # Each curl printed the route's JSON answer: the checksum, then the perturbation's checksums.
    assert '"checksum"' in result.stdout and '"checksum_after"' in result.stdout
    assert '"weight_version"' in result.stdout and '"kv_bytes"' in result.stdout


# ---- tiny model dirs ---------------------------------------------------------------------------


def test_tiny_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_blocks()["tiny-models"][1], "README.md:tiny-models", "exec"), {})
    written = sorted(p.parent.name for p in tmp_path.glob("tiny/*/config.json"))
    assert written == ["llama3", "qwen2", "qwen3", "qwen3-moe", "random-llama"]
    assert all((tmp_path / "tiny" / name / "tokenizer.json").exists() for name in written)


# ---- the pods block, two processes under the local launcher ------------------------------------

POD_PLACEHOLDERS = """
import numpy as np
from models import QwenConfig, QwenForCausalLM

MODEL_DIR = {model_dir!r}
config = WorkerConfig(model_path=MODEL_DIR, tp_size=1, max_total_tokens=2048, context_length=256)  # one CPU device


def init_params(rng):
    return QwenForCausalLM(QwenConfig.from_hf(MODEL_DIR)).init(rng, np.zeros((1, 4), np.int32))["params"]


rng, prompts, k, step = jax.random.key(0), [[5, 17, 42, 8], [100, 3], [250, 251, 7], [9, 9, 9]], 2, 0
"""


def test_pods(qwen2_dir, tmp_path):
    from rollout.launch import launch_local

    supplied = dict.fromkeys(["config", "init_params", "rng", "prompts", "k", "step"])
    program = tmp_path / "pods_block.py"
    definitions = POD_PLACEHOLDERS.format(model_dir=str(qwen2_dir))
    program.write_text(
        without_placeholders(readme_blocks()["pods"][1], supplied, definitions)
        + "print('ROWS', batch.tokens.shape[0], flush=True)\n"
    )
    results = launch_local([str(program)], 2, devices_per_process=1, timeout_s=600)
    assert all(r.returncode == 0 for r in results), [r.log[-2000:] for r in results]
    assert all("ROWS 16" in r.log for r in results)
