"""The worker and the server under faults and impolite clients (issue 19): typed errors and
their statuses, admission limits, NaN on every load path, OpenAI conformance details."""

import logging

import httpx
import pytest

from models.tiny import TinyModelSpec, write_tiny_model
from rollout import RolloutWorker
from rollout.errors import InvalidRequest, WorkerClosed, WorkerUnavailable
from rollout.server import Server, ServerConfig, WorkerBackend
from tests.helpers import tiny_worker_config

PROMPT = [5, 17, 42, 8]
ADMIN_TOKEN = "admin-faults"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("chat"), TinyModelSpec(chat_template=True))


@pytest.fixture(scope="module")
def worker(chat_dir):
    with RolloutWorker(tiny_worker_config(chat_dir)) as w:
        yield w


@pytest.fixture(scope="module")
def server(worker):
    with worker.serve(admin_token=ADMIN_TOKEN, served_model_name="tiny") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def chat_dir_name(worker) -> str:
    return WorkerBackend(worker).model_name


def complete(http, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **body})


# ---- typed errors ------------------------------------------------------------------------------


def test_worker_errors_are_typed_and_name_the_field(worker, chat_dir):
    with pytest.raises(InvalidRequest) as bad_n:
        worker.generate([PROMPT], n=1.5)
    assert bad_n.value.field == "n"
    with pytest.raises(InvalidRequest) as bad_prompt:
        worker.generate([PROMPT, [5, 10**9]])
    assert bad_prompt.value.field == "prompts[1]"
    with pytest.raises(InvalidRequest) as too_long:
        worker.generate([PROMPT], max_new_tokens=10_000)
    assert too_long.value.field == "max_new_tokens"
    with worker.released_for_training():
        pass
    with pytest.raises(WorkerUnavailable) as stale:
        worker.generate([PROMPT])
    assert "train step" in stale.value.reason and stale.value.retryable
    worker.load_hf(chat_dir)


class _FailingBackend(WorkerBackend):
    """A backend whose generate fails the way a failed KV rebuild during admission did."""

    async def generate(self, prompts, **sampling):
        raise RuntimeError("KV rebuild failed: out of memory")


def test_an_unknown_error_is_a_500_with_a_request_id_never_a_503(worker, caplog):
    with Server(_FailingBackend(worker), ServerConfig(port=0)) as server, caplog.at_level(logging.ERROR, "rollout"):
        response = httpx.post(server.url + "/v1/completions", json={"model": chat_dir_name(worker), "prompt": PROMPT})
    assert response.status_code == 500, response.text
    assert "retry-after" not in response.headers
    error = response.json()["error"]
    assert error["type"] == "server_error" and "KV rebuild failed" in error["message"]
    request_id = error["message"].split("request id ")[1].split(")")[0]
    assert any(request_id in record.getMessage() for record in caplog.records)
