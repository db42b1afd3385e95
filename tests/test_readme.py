"""Every code block of the README and of docs/ runs as written, so the guide stays true.

Each block is preceded by ``<!-- readme-block: ID -->`` (IDs unique across README.md and
docs/*.md) and has a plan (tests/unit/test_readme.py checks): run it (Python in this process
or under the local pod launcher, shell with bash), or skip it with the reason. Lines marked
``# placeholder`` are the reader's to fill: the test drops them and supplies the names they
define (a tiny model, a param tree, a stand-in train step). The other changes a plan makes are
listed with it (a free port for the guide's 8000). The guide's relative links must resolve,
and the README stays a guide: at most 300 lines, the details in docs/.
"""

import functools
import json
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

from models import flax_model_for, write_tiny_model
from models.tiny import tiny_llama3_spec
from tests.helpers import BLOCK, DOCS, README, REPO, block_code, guide_files, source_name
from trainer_bridge import load_hf_params

# The guide's text does not change with the JAX version: one end (the newest) runs its blocks (the
# calls they make are tested at both ends by the rest of the suite).
pytestmark = pytest.mark.one_end

README_MAX_LINES = 300
FENCE = re.compile(r"^ *```", re.M)  # indented fences too: a block in a list item needs its marker as well
PLACEHOLDER = "# placeholder"


@pytest.mark.parametrize("path", guide_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_fence_has_a_marker(path):
    text = path.read_text()
    fences = len(FENCE.findall(text))
    assert fences % 2 == 0, f"{path.name}: an unclosed fence"
    marked = len(BLOCK.findall(text))
    assert marked == fences // 2, (
        f"{path.name}: every fenced block needs a <!-- readme-block: ID --> line right before it"
    )


def test_readme_is_a_guide():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move details to docs/"


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    anchors = set()
    for title in re.findall(r"^#+ +(.+?) *$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M), re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"))
    return anchors


def test_design_lists_every_workaround():
    from rollout.engine.workarounds import WORKAROUNDS

    listed = re.findall(r"^\| `([a-z0-9-]+)` \|", (DOCS / "design.md").read_text(), re.M)
    assert sorted(listed) == sorted(WORKAROUNDS), "docs/design.md's workaround table must list WORKAROUNDS exactly"


@pytest.mark.parametrize("path", guide_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(path):
    """Relative links (README <-> docs/, docs -> code) name files that exist, and headings that do."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            broken.append(target)
    assert not broken, f"{path.name}: broken links {broken}"


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
    exec(compile(without_placeholders(block_code(block), supplied), source_name(block), "exec"), namespace)
    return namespace


def test_use(llama_dir):
    params = load_hf_params(llama_dir)
    namespace = run_python(
        "use",
        dict(
            model_dir=str(llama_dir),
            params=params,
            opt_state=jnp.zeros(()),
            train_step=_train_step,
            prompts=["1+2=", "7+5="],
        ),
    )
    batch, report = namespace["batch"], namespace["report"]
    assert batch.tokens.shape == (2 * 8, 256 + 256)
    assert int(namespace["opt_state"]) == 16  # the train step ran
    # The train step's tree (its shardings as jit spells them) synced without compiling.
    assert report.version == 2 and report.compiles == 0


def test_logprobs(qwen2_dir):
    from rollout import RolloutWorker
    from tests.helpers import tiny_worker_config

    params = load_hf_params(qwen2_dir)
    with RolloutWorker(tiny_worker_config(qwen2_dir, load_format="dummy", context_length=512)) as worker:
        worker.sync_params(params)
        namespace = run_python("logprobs", dict(worker=worker, params=params, prompts=["1+2=", "7+5="]))
    assert (
        namespace["report"].max_abs_diff < 1e-3 and namespace["batch"].logprobs.shape == namespace["batch"].tokens.shape
    )


def test_routing_replay(moe_dir):
    params = load_hf_params(moe_dir)
    model = flax_model_for(json.loads((moe_dir / "config.json").read_text()))
    supplied = dict(moe_dir=str(moe_dir), model=model, params=params, prompts=[[5, 17, 42], [100, 3]])
    namespace = run_python("routing-replay", supplied)
    batch = namespace["batch"]
    assert batch.routed_experts.shape == batch.tokens.shape + (1, 2)
    assert namespace["logits"].shape == batch.tokens.shape + (model.config.vocab_size,)
    assert namespace["report"].max_abs_diff < 0.25  # a bfloat16 engine (the default), replayed


def test_episodes(chat_dir):
    from rollout import RolloutWorker
    from tests.helpers import tiny_worker_config

    # The tools block of the tiny template at a token per byte or so: a long prompt.
    with RolloutWorker(tiny_worker_config(chat_dir, context_length=1024, max_total_tokens=8192)) as worker:
        namespace = run_python("episodes", dict(worker=worker))
        out = namespace["out"]
        assert out.batch.size == 4 and len(out.episodes) == 4
        assert all(e.turns and e.status in ("done", "max_turns", "length") for e in out.episodes)
        assert out.batch.completion_mask.sum() == sum(int(e.loss_mask.sum()) for e in out.episodes)
        assert worker.session_stats()[0].sessions == 0


# ---- the server, its client and its admin routes --------------------------------------------


@pytest.fixture(scope="module")
def served(chat_dir):
    """serve-cpu as written, on a free port instead of 8000 and the session's chat model."""
    port = free_port()
    command = block_code("serve-cpu").replace("--port 8000", f"--port {port}")
    # `python` is this environment's, as for a reader who activated it.
    env = dict(
        os.environ, MODEL_DIR=str(chat_dir), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )
    env.pop("XLA_FLAGS", None)
    process = subprocess.Popen(
        ["bash", "-c", command], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the guide's server did not get ready in 240 s"
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
    code = block_code("client").replace("127.0.0.1:8000", f"127.0.0.1:{served}")
    exec(compile(code, source_name("client"), "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip()


def test_admin(served):
    code = block_code("admin").replace("127.0.0.1:8000", f"127.0.0.1:{served}")
    result = subprocess.run(
        ["bash", "-e", "-c", code],
        env=dict(os.environ, ROLLOUT_ADMIN_TOKEN="secret"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    # Each curl printed the route's JSON answer: the checksum, then the perturbation's checksums.
    assert '"checksum"' in result.stdout and '"checksum_after"' in result.stdout
    assert '"weight_version"' in result.stdout and '"kv_bytes"' in result.stdout


# ---- the pods block, two processes under the local launcher ------------------------------------

POD_PLACEHOLDERS = """
import numpy as np
from models import DecoderConfig, CausalLM

MODEL_DIR = {model_dir!r}
config = WorkerConfig(model_path=MODEL_DIR, tp_size=1, max_total_tokens=2048, context_length=256)  # one CPU device


def init_params(rng):
    return CausalLM(DecoderConfig.from_hf(MODEL_DIR)).init(rng, np.zeros((1, 4), np.int32))["params"]


rng, prompts, k, step = jax.random.key(0), [[5, 17, 42, 8], [100, 3], [250, 251, 7], [9, 9, 9]], 2, 0
"""


def test_pods(qwen2_dir, tmp_path):
    from rollout.launch import launch_local

    supplied = dict.fromkeys(["config", "init_params", "rng", "prompts", "k", "step"])
    program = tmp_path / "pods_block.py"
    definitions = POD_PLACEHOLDERS.format(model_dir=str(qwen2_dir))
    program.write_text(
        without_placeholders(block_code("pods"), supplied, definitions)
        + "print('ROWS', batch.tokens.shape[0], flush=True)\n"
    )
    results = launch_local([str(program)], 2, devices_per_process=1, timeout_s=600)
    assert all(r.returncode == 0 for r in results), [r.log[-2000:] for r in results]
    assert all("ROWS 16" in r.log for r in results)
