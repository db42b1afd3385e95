"""The worker and the server under faults and impolite clients (issue 19): typed errors and
their statuses, admission limits, NaN on every load path, OpenAI conformance details."""

import asyncio
import contextlib
import ctypes
import gc
import json
import logging
import re
import signal
import socket
import threading

import httpx
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file, save_file

from rollout import RolloutWorker
from rollout.errors import InvalidRequest, LimitExceeded, WorkerClosed, WorkerUnavailable
from rollout.server import Server, ServerConfig, WorkerBackend
from tests.helpers import donated_during, serve_process, tiny_worker_config, wait_until
from trainer_bridge import SyncError, load_hf_params

PROMPT = [5, 17, 42, 8]
ADMIN_TOKEN = "admin-faults"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def worker(chat_dir):
    with RolloutWorker(tiny_worker_config(chat_dir)) as w:
        yield w


@pytest.fixture(scope="module")
def server(worker):
    limits = dict(max_prompts_per_request=64, max_rows_per_request=128, max_tokens_per_request=4096)
    with worker.serve(admin_token=ADMIN_TOKEN, served_model_name="tiny", **limits) as s:
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


@pytest.mark.one_end
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
    try:
        with pytest.raises(WorkerUnavailable) as stale:
            worker.generate([PROMPT])
        assert "train step" in stale.value.reason and stale.value.retryable
    finally:  # serving again for the module's later tests, whatever failed here
        worker.load_hf(chat_dir)


class _FailingBackend(WorkerBackend):
    """A backend whose generate fails the way a failed KV rebuild during admission did."""

    async def generate(self, prompts, **sampling):
        raise RuntimeError("KV rebuild failed: out of memory")


@pytest.mark.one_end
def test_an_unknown_error_is_a_500_with_a_request_id_never_a_503(worker, caplog):
    with Server(_FailingBackend(worker), ServerConfig(port=0)) as server, caplog.at_level(logging.ERROR, "rollout"):
        response = httpx.post(server.url + "/v1/completions", json={"model": chat_dir_name(worker), "prompt": PROMPT})
    assert response.status_code == 500, response.text
    assert "retry-after" not in response.headers
    error = response.json()["error"]
    assert error["type"] == "server_error" and "KV rebuild failed" in error["message"]
    request_id = error["message"].split("request id ")[1].split(")")[0]
    assert any(request_id in record.getMessage() for record in caplog.records)


# ---- API misuse ----------------------------------------------------------------------------------


@pytest.mark.one_end
def test_bad_arguments_are_clear_errors(worker):
    with pytest.raises(InvalidRequest) as pad:
        worker.generate([PROMPT], pad_prompts_to="x")
    assert pad.value.field == "pad_prompts_to"
    with pytest.raises(InvalidRequest, match=r"pad_prompts_to=1099511627776 is wider than a request may be") as pad:
        worker.generate([PROMPT], pad_prompts_to=2**40)  # packed after the generation: 4 TiB
    assert pad.value.field == "pad_prompts_to"

    async def stream_padded():
        async for _ in worker.astream([PROMPT], pad_prompts_to=8):
            pass

    with pytest.raises(TypeError, match="pad_prompts_to"):
        asyncio.run(stream_padded())
    with pytest.raises(InvalidRequest) as surrogate:
        worker.generate(["ok", "\ud800abc"])
    assert surrogate.value.field == "prompts[1]" and "Unicode" in str(surrogate.value)


@pytest.mark.one_end
@pytest.mark.parametrize("call", ["generate", "astream"])
def test_close_during_a_call_fails_it_promptly_and_the_worker_says_closed_everywhere(qwen2_dir, caplog, call):
    threads_before = set(threading.enumerate())
    worker = RolloutWorker(tiny_worker_config(qwen2_dir))
    engine = worker.engine
    server = worker.serve()
    try:
        # Compiled first: close() stops the scheduler between forwards, and a first forward's
        # compile on a loaded machine can outlast close()'s 30 s wait.
        worker.generate([PROMPT], max_new_tokens=4, ignore_eos=True)
        outcome = {}

        async def stream():
            async for _ in worker.astream([PROMPT], n=2, max_new_tokens=240, ignore_eos=True):
                pass

        def long_call():
            try:
                if call == "generate":
                    worker.generate([PROMPT], n=2, max_new_tokens=240, ignore_eos=True)
                else:
                    asyncio.run(stream())
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                outcome["error"] = exc

        caller = threading.Thread(target=long_call)
        caller.start()
        wait_until(lambda: engine.requests_in_flight > 0)
        worker.close()
        caller.join(timeout=60)
        assert not caller.is_alive(), "the running call did not return after close()"
        assert isinstance(outcome.get("error"), WorkerClosed), outcome
        # No task left pending with the engine's stopped loop: once collected, asyncio logs
        # each ("Task was destroyed but it is pending!": a stream's waits in the engine).
        gc.collect()
        assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]
        assert not [t.name for t in set(threading.enumerate()) - threads_before if t.name.startswith("sglang-jax::")]
        body = {"model": qwen2_dir.name, "prompt": PROMPT, "max_tokens": 2}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "worker_closed" and "retry-after" not in response.headers
        assert httpx.get(server.url + "/ready").status_code == 503
        with pytest.raises(WorkerClosed):
            worker.param_shardings()
        with pytest.raises(WorkerClosed):
            worker.serve()
        with pytest.raises(WorkerClosed):
            worker.load_hf(qwen2_dir)
        # These had reached the stopped engine (an AttributeError) or a cached plan.
        with pytest.raises(WorkerClosed):
            worker.check_sampling(temperature=1.0)
        with pytest.raises(WorkerClosed):
            worker.sync_memory_analysis({})
    finally:
        server.close()
        worker.close()  # where the test failed before its own close: no engine left running


@pytest.mark.one_end
@pytest.mark.parametrize("in_flight", [True, False], ids=["in-flight", "drain"])
def test_close_during_a_sync_fails_it_with_worker_closed(qwen2_dir, monkeypatch, in_flight):
    """A sync that close() overtakes (its new leaves prepared, the engines gone before the swap)
    fails as every call close() ends does: WorkerClosed, not the engine's shutdown error."""
    from rollout.weights import EngineWeights

    params = load_hf_params(qwen2_dir)
    worker = RolloutWorker(tiny_worker_config(qwen2_dir, load_format="dummy"))
    try:
        worker.sync_params(params)
        preparing, closed = threading.Event(), threading.Event()
        prepare = EngineWeights.prepare

        def prepare_then_wait_for_close(self, *args, **kwargs):
            preparing.set()
            assert closed.wait(60), "close() did not return"
            return prepare(self, *args, **kwargs)

        monkeypatch.setattr(EngineWeights, "prepare", prepare_then_wait_for_close)
        outcome = {}

        def sync():
            try:
                worker.sync_params(params, in_flight=in_flight)
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                outcome["error"] = exc

        caller = threading.Thread(target=sync)
        caller.start()
        assert preparing.wait(60)
        worker.close()
        closed.set()
        caller.join(timeout=60)
        assert not caller.is_alive()
        assert isinstance(outcome.get("error"), WorkerClosed), outcome
    finally:
        worker.close()


# ---- admission limits ----------------------------------------------------------------------------


@pytest.mark.one_end
def test_admission_limits_refuse_oversized_calls(worker):
    with pytest.raises(LimitExceeded) as rows:
        worker.generate([PROMPT], n=100_000, max_new_tokens=1)
    assert rows.value.limit == "WorkerConfig.max_rows_per_call" and rows.value.value == 100_000
    defaults = ServerConfig()
    assert (defaults.max_prompts_per_request, defaults.max_rows_per_request) == (256, 1024)


@pytest.mark.one_end
@pytest.mark.parametrize(
    "body,limit",
    [
        ({"prompt": [[5, 6]] * 1000, "n": 128, "max_tokens": 1}, "ServerConfig.max_prompts_per_request"),
        ({"prompt": [[5, 6]] * 2, "n": 100, "max_tokens": 1}, "ServerConfig.max_rows_per_request"),
        ({"prompt": PROMPT, "n": 16, "max_tokens": 255, "ignore_eos": True}, "ServerConfig.max_tokens_per_request"),
    ],
    ids=["prompts", "rows", "tokens"],
)
def test_admission_limits_answer_413_naming_the_limit(http, body, limit):
    response = http.post("/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 413, response.text
    assert limit in response.json()["error"]["message"]
    assert complete(http).status_code == 200


# ---- NaN on every load path ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def nan_sources(chat_dir, tmp_path_factory):
    """The chat model's weights with one NaN: an orbax checkpoint and an HF directory."""
    root = tmp_path_factory.mktemp("nan")
    params = load_hf_params(chat_dir)
    flat = jax.tree_util.tree_leaves_with_path(params)
    path, value = flat[-1]
    broken = np.array(value, copy=True)
    broken.reshape(-1)[0] = np.nan
    params = jax.tree_util.tree_map_with_path(lambda p, v: broken if p == path else v, params)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(root / "ckpt", jax.tree_util.tree_map(jax.device_put, params))
    checkpointer.wait_until_finished()
    hf = root / "hf"
    hf.mkdir()
    for file in chat_dir.iterdir():
        if file.suffix != ".safetensors":
            (hf / file.name).write_bytes(file.read_bytes())
    tensors = load_file(chat_dir / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].copy()
    tensors[name].reshape(-1)[0] = np.nan
    save_file(tensors, hf / "model.safetensors")
    return root / "ckpt", hf


def checksum(http) -> str:
    response = http.get("/admin/weights_checksum", headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()["checksum"]


@pytest.mark.one_end
def test_nan_weights_are_refused_on_every_load_path(worker, http, nan_sources, chat_dir):
    ckpt, hf = nan_sources
    before, version = checksum(http), worker.weight_version
    with pytest.raises(SyncError, match="non-finite"):
        worker.load_checkpoint(ckpt)
    with pytest.raises(SyncError, match="non-finite"):
        worker.load_hf(hf)
    for body in ({"path": str(ckpt), "format": "orbax"}, {"path": str(hf), "format": "hf"}):
        response = http.post("/admin/reload_weights", json=body, headers=ADMIN)
        assert response.status_code == 400 and "non-finite" in response.json()["error"]["message"], response.text
    inf = http.post("/admin/perturb_weights", json={"seed": 1, "scale": 1e308, "num_leaves": 2}, headers=ADMIN)
    assert inf.status_code == 400 and inf.json()["error"]["param"] == "scale", inf.text
    assert checksum(http) == before and worker.weight_version == version
    assert complete(http).status_code == 200
    # The opt-out, as for sync_params.
    worker.load_hf(hf, check_finite=False)
    assert checksum(http) != before
    worker.load_hf(chat_dir)
    assert checksum(http) == before


# ---- statuses --------------------------------------------------------------------------------------


@pytest.mark.one_end
def test_former_500s_are_4xx(http):
    surrogate = http.post(
        "/v1/completions",
        content=b'{"model": "tiny", "prompt": "\\ud800abc"}',
        headers={"Content-Type": "application/json"},
    )
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "prompt", surrogate.text
    chat = http.post(
        "/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
        headers={"Content-Type": "application/json"},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages[0].content", chat.text
    seed = http.post("/admin/perturb_weights", json={"seed": 2**70, "scale": 0.1}, headers=ADMIN)
    assert seed.status_code == 400 and seed.json()["error"]["param"] == "seed", seed.text


@pytest.mark.one_end
def test_reloads_outside_the_reload_root_are_refused(worker, chat_dir, tmp_path):
    with worker.serve(admin_token=ADMIN_TOKEN, reload_root=str(tmp_path)) as server:
        for path in (str(chat_dir), str(tmp_path / ".." / chat_dir.name), "/etc/nope"):
            response = httpx.post(
                server.url + "/admin/reload_weights", json={"path": path, "format": "hf"}, headers=ADMIN, timeout=60
            )
            assert response.status_code == 403 and response.json()["error"]["code"] == "outside_reload_root", (
                response.text
            )


# ---- OpenAI conformance ------------------------------------------------------------------------------


@pytest.mark.one_end
def test_request_fields_as_openai_defines_them(http):
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    assert http.get("/v1/models/gpt-9").status_code == 404
    bad_usage = complete(http, stream=True, stream_options={"include_usage": "x"})
    assert bad_usage.status_code == 400 and bad_usage.json()["error"]["param"] == "stream_options"
    not_streamed = complete(http, stream_options={"include_usage": True})
    assert not_streamed.status_code == 400 and not_streamed.json()["error"]["param"] == "stream_options"
    for seed in (-1, 2**40, -(2**63), 2**63 - 1):
        first = complete(http, seed=seed, max_tokens=6, ignore_eos=True)
        assert first.status_code == 200, first.text
        assert (
            complete(http, seed=seed, max_tokens=6, ignore_eos=True).json()["choices"][0]["token_ids"]
            == first.json()["choices"][0]["token_ids"]
        )


def sse(response: httpx.Response) -> list[dict]:
    events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.one_end
def test_streamed_usage_is_null_until_the_last_chunk(http):
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 4,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        chunks = sse(response)
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == sum(
        len(c["choices"][0].get("token_ids", [])) for c in chunks[:-1] if c["choices"]
    )


@pytest.mark.one_end
def test_chat_logprob_bytes_are_each_tokens_own(http, worker):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 48,
        "temperature": 1.0,
        "seed": 4,
        "n": 2,
        "logprobs": True,
        "ignore_eos": True,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    # The tokens the content's decode skips (skip_special_tokens): the named ones and every
    # added special token (<|im_end|> is not in all_special_ids, and ignore_eos may sample it).
    tokenizer = worker.tokenizer
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    partial = 0
    for choice in response.json()["choices"]:
        entries = [e for e, t in zip(choice["logprobs"]["content"], choice["token_ids"]) if t not in special]
        joined = b"".join(bytes(e["bytes"]) for e in entries)
        assert joined.decode("utf-8", errors="replace") == choice["message"]["content"]
        partial += sum(1 for e in entries if bytes(e["bytes"]) and not _valid_utf8(bytes(e["bytes"])))
    assert partial > 0  # the check saw tokens that hold part of a character


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def streamed(http, body) -> dict:
    """A streamed completion's choice 0 put together: text, token ids, log-probs, offsets, usage."""
    result = {"text": "", "token_ids": None, "logprobs": [], "text_offset": [], "tokens": [], "finish_reason": None}
    with http.stream(
        "POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as response:
        assert response.status_code == 200
        for chunk in sse(response):
            if chunk["usage"] is not None:
                result["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                result["text"] += choice["text"]
                if choice["logprobs"]:
                    result["logprobs"] += choice["logprobs"]["token_logprobs"]
                    result["text_offset"] += choice["logprobs"]["text_offset"]
                    result["tokens"] += choice["logprobs"]["tokens"]
                result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
                result["token_ids"] = choice.get("token_ids", result["token_ids"])
    return result


@pytest.mark.one_end
def test_streamed_text_offsets_match_the_non_streamed(http):
    body = {
        "model": "tiny",
        "prompt": "1+2=",
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": 11,
        "ignore_eos": True,
        "logprobs": 0,
    }
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    offsets = plain["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] > 0
    stream = streamed(http, body)
    assert stream["text_offset"] == offsets
    assert stream["text"] == plain["text"]


@pytest.mark.one_end
def test_a_stop_string_cuts_every_field_alike_streamed_or_not(http, worker):
    body = {"model": "tiny", "prompt": "1+2=", "max_tokens": 32, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    full = http.post("/v1/completions", json=body).json()["choices"][0]
    tokenizer = worker.tokenizer
    # A stop string spanning two tokens, well inside the completion.
    texts = [
        tokenizer.decode(full["token_ids"][:k], skip_special_tokens=True) for k in range(len(full["token_ids"]) + 1)
    ]
    k = next(
        k for k in range(4, len(texts) - 2) if len(texts[k]) > len(texts[k - 1]) and len(texts[k + 1]) > len(texts[k])
    )
    stop = texts[k + 1][len(texts[k]) - 1 :]
    cut_at = full["text"].index(stop)
    request = {**body, "stop": [stop]}
    plain = http.post("/v1/completions", json=request).json()
    choice = plain["choices"][0]
    assert choice["text"] == full["text"][:cut_at] and choice["finish_reason"] == "stop"
    kept = choice["token_ids"]
    assert tokenizer.decode(kept, skip_special_tokens=True).startswith(choice["text"])
    assert len(tokenizer.decode(kept[:-1], skip_special_tokens=True)) < len(choice["text"])  # no token past the text
    assert len(choice["logprobs"]["token_logprobs"]) == len(kept) == plain["usage"]["completion_tokens"]
    stream = streamed(http, request)
    assert (stream["text"], stream["token_ids"], stream["finish_reason"]) == (choice["text"], kept, "stop")
    assert stream["logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-6)
    assert stream["text_offset"] == choice["logprobs"]["text_offset"]
    assert stream["usage"]["completion_tokens"] == len(kept)


# ---- signals: drain and exit 0 -----------------------------------------------------------------------


def _sigterm_handler_address() -> int:
    """The process's SIGTERM handler as the kernel holds it (Python's signal module only sees
    handlers it installed itself): the first field of struct sigaction."""
    libc = ctypes.CDLL(None, use_errno=True)
    action = ctypes.create_string_buffer(512)
    assert libc.sigaction(signal.SIGTERM, None, action) == 0
    return ctypes.c_void_p.from_buffer(action).value


def test_the_engines_forwards_leave_the_sigterm_handler_alone(qwen2_dir):
    """0.0.2 imports ``jax._src.test_util`` in every forward; its first import installs absl's
    failure handler over the process's SIGTERM handler (a server's drain then never runs)."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        before = _sigterm_handler_address()
        with RolloutWorker(tiny_worker_config(qwen2_dir)) as fresh:
            fresh.generate([PROMPT], max_new_tokens=2, temperature=0.0)
            assert _sigterm_handler_address() == before
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize(
    "signum,drain_s,whole,again",
    [(signal.SIGTERM, 120, True, False), (signal.SIGINT, 0, False, False), (signal.SIGTERM, 120, True, True)],
    ids=["SIGTERM", "SIGINT-past-the-drain-timeout", "SIGTERM-twice"],
)
def test_a_signal_during_a_request_drains_it_and_exits_0(chat_dir, signum, drain_s, whole, again):
    """``python -m rollout.serve`` got a signal while a stream runs: the stream ends whole (or,
    past the drain timeout, is cut and its rows aborted), then the process exits 0 (it aborted
    with absl's stack dump, exit 134; or, past the drain, hung on the busy engine and aborted).
    ``again``: a second SIGTERM once the drain began lets it and the engine's shutdown go on (it
    killed the process); its stream is long enough to be running when the signal lands."""
    with serve_process(chat_dir, "--drain-timeout-s", str(drain_s)) as (process, url):
        # Compiles the forwards, and imports what the engine imports on its first forward.
        warm = httpx.post(
            url + "/v1/completions", json={"model": chat_dir.name, "prompt": PROMPT, "max_tokens": 2}, timeout=120
        )
        assert warm.status_code == 200
        body = {
            "model": chat_dir.name,
            "prompt": PROMPT,
            "max_tokens": 24 if whole and not again else 240,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # running
            process.send_signal(signum)
            if again:
                assert any("draining running requests" in line for line in process.stderr)
                process.send_signal(signum)
            try:
                rest = [line for line in lines if line.startswith("data: ")]
            except httpx.RemoteProtocolError:  # cut mid-stream
                rest = []
        if whole:
            assert rest[-1] == "data: [DONE]"
            assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
        else:
            assert "data: [DONE]" not in rest
        assert process.wait(timeout=120) == 0


@pytest.mark.one_end
def test_a_second_ctrl_c_while_draining_stops_at_once_without_a_traceback(chat_dir):
    """Ctrl-C again while a stream drains stops the command at once, as docs/server.md says:
    exit 130 and one line, where it printed a KeyboardInterrupt traceback."""
    with serve_process(chat_dir, "--drain-timeout-s", "120") as (process, url):
        body = {"model": chat_dir.name, "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # running
            process.send_signal(signal.SIGINT)
            assert any("draining running requests" in line for line in process.stderr)
            process.send_signal(signal.SIGINT)
            with contextlib.suppress(httpx.TransportError):  # cut mid-stream
                for _ in lines:
                    pass
        assert process.wait(timeout=120) == 130
        rest = process.stderr.read()
        assert "interrupted while draining; stopped" in rest and "Traceback" not in rest


# ---- aborts: abandoned work stops within a forward --------------------------------------------------

LONG = 240  # tokens a request would generate for nobody (the context is 256)


def abandoned_forwards(worker, start: int) -> int:
    """Forwards the engine ran from ``start`` until it holds no request, once idle again;
    also checks that the KV cache was given back."""
    engine = worker.engine
    wait_until(lambda: engine.requests_in_flight == 0 and worker.active_calls == 0)
    spent = engine.forward_count - start
    assert engine.testing.kv_tokens_held() == 0
    return spent


@pytest.mark.one_end
def test_a_cancelled_agenerate_aborts_its_rows(worker):
    engine = worker.engine

    async def cancelled() -> int:
        call = asyncio.ensure_future(worker.agenerate([PROMPT], max_new_tokens=LONG, ignore_eos=True))
        while engine.requests_in_flight == 0:
            await asyncio.sleep(0.005)
        start = engine.forward_count
        call.cancel()  # what asyncio.wait_for does when it times out
        with pytest.raises(asyncio.CancelledError):
            await call
        return start

    start = asyncio.run(cancelled())
    assert abandoned_forwards(worker, start) < LONG // 4


def test_weights_donated_during_a_call_fail_it_and_the_next_sync_serves_again(worker, chat_dir):
    """A train step donating the served params while a generate runs (outside
    released_for_training): the call fails with WorkerUnavailable saying why, and the engine
    serves again after the next sync (its thread failed for good: only a new worker served)."""
    params = jax.device_put(load_hf_params(chat_dir), worker.param_shardings())
    greedy = dict(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    try:
        assert worker.sync_params(params).bytes_copied == 0  # the engine serves the trainer's arrays
        expected = worker.generate([PROMPT], **greedy).completions
        engine = worker.engine
        stepped, error = donated_during(
            lambda: worker.generate([PROMPT], n=4, max_new_tokens=LONG, ignore_eos=True),
            lambda: engine.requests_in_flight > 0,
            params,
        )
        assert isinstance(error, WorkerUnavailable) and re.search("freed while it ran .* rows were aborted", str(error))
        assert engine.alive and engine.requests_in_flight == 0 and engine.testing.kv_tokens_held() == 0
        assert engine.testing.requests_remembered() == 0
        with pytest.raises(WorkerUnavailable, match="were freed"):
            worker.generate([PROMPT], **greedy)
        worker.sync_params(stepped)
        assert worker.generate([PROMPT], **greedy).completions == expected
    finally:  # serving the model's own weights for the module's later tests
        worker.load_hf(chat_dir)


class Interrupted(BaseException):
    """Stands in for KeyboardInterrupt, which pytest would take as its own."""


@pytest.mark.one_end
def test_an_interrupted_blocking_generate_aborts_its_rows(worker):
    """Ctrl-C in a blocking generate left its rows generating: the next KV drop, drain sync or
    train step's release waited for them."""
    engine, main, started = worker.engine, threading.get_ident(), []

    def interrupt(signum, frame):
        raise Interrupted()

    def interrupter():
        wait_until(lambda: engine.requests_in_flight > 0)
        started.append(engine.forward_count)
        signal.pthread_kill(main, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    thread = threading.Thread(target=interrupter, daemon=True)
    thread.start()
    try:
        with pytest.raises(Interrupted):
            worker.generate([PROMPT], max_new_tokens=LONG, ignore_eos=True)
    finally:
        thread.join(timeout=60)
        signal.signal(signal.SIGUSR1, previous)
    assert abandoned_forwards(worker, started[0]) < LONG // 4


@pytest.mark.one_end
def test_a_call_cancelled_while_its_rows_wait_in_the_queue_leaves_no_request_state(worker):
    """0.0.2 answers the abort of a queued request without deleting its state: every call
    cancelled before its rows were admitted (a client gone at once) stayed in the tokenizer
    manager's requests for the engine's life."""
    engine = worker.engine
    full = worker.config.max_running_requests
    remembered = engine.testing.requests_remembered()

    async def until(condition):
        for _ in range(60_000):  # a bound for the failure only
            if condition():
                return
            await asyncio.sleep(0.001)
        raise AssertionError("the engine never got there")

    async def main():
        prompts = [[5 + i, 17, 42, 8] for i in range(full)]
        # 16 x 124 tokens fit the 2048-token pool: no row is retracted to the queue behind them.
        running = asyncio.create_task(worker.agenerate(prompts, max_new_tokens=120, ignore_eos=True))
        await until(lambda: engine.requests_in_flight == full)
        before = engine.testing.request_states()
        queued = asyncio.create_task(worker.agenerate([PROMPT[:2], PROMPT[:3]], max_new_tokens=4))
        await until(lambda: engine.requests_in_flight == full + 2)  # the running batch is full: they wait
        states = {rid: s for rid, s in engine.testing.request_states().items() if rid not in before}
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        await until(lambda: all(state.finished for state in states.values()))  # their aborts answered
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        return states

    states = asyncio.run(main())
    assert len(states) == 2 and not set(states) & set(engine.testing.request_states())
    wait_until(lambda: engine.requests_in_flight == 0 and worker.active_calls == 0)
    wait_until(lambda: engine.testing.requests_remembered() == remembered == 0)


class _InterruptedOnce:
    """A future whose first wait is interrupted (Ctrl-C landing as its caller starts waiting)."""

    def __init__(self, future):
        self._future, self._interrupted = future, False

    def result(self, timeout=None):
        if not self._interrupted:
            self._interrupted = True
            raise KeyboardInterrupt
        return self._future.result(timeout)

    def done(self):
        return self._future.done()


def _sigint_then_wait(wait):
    """A Ctrl-C as the caller starts waiting for the engine (the signal's handler runs before
    the wait's own code)."""

    def sigint_then_wait(self, future):
        signal.raise_signal(signal.SIGINT)
        return wait(self, future)

    return sigint_then_wait


@pytest.mark.one_end
@pytest.mark.parametrize("in_flight", [False, True], ids=["drain", "in-flight"])
@pytest.mark.parametrize("how", ["sigint", "raised-in-the-wait"])
def test_a_ctrl_c_while_the_engines_swap_raises_once_the_version_they_serve_is_recorded(
    worker, chat_dir, monkeypatch, in_flight, how
):
    """The engine ran the queued swap anyway (it cannot be taken back), while the worker kept the
    old version: the new weights served under it, and the next sync gave its version to a
    second set of weights. Python's own SIGINT handler is recorded wherever the signal lands;
    a KeyboardInterrupt raised otherwise (a program's own handler) while the caller waits for
    the engine is deferred there."""
    from rollout.engine import EngineHandle

    params = load_hf_params(chat_dir)
    worker.sync_params(params)
    version, expected = worker.weight_version, worker.generate([PROMPT], max_new_tokens=4, temperature=0.0)
    scaled = jax.tree_util.tree_map(lambda x: x * 1.5, params)
    wait = EngineHandle._wait
    # CI's processes start in the background, SIGINT ignored: the SIGINT case installs Python's
    # own handler, as an interactive program has; the other keeps whatever is installed.
    inherited = signal.getsignal(signal.SIGINT)
    try:
        if how == "sigint":
            signal.signal(signal.SIGINT, signal.default_int_handler)
            monkeypatch.setattr(EngineHandle, "_wait", _sigint_then_wait(wait))
        else:
            monkeypatch.setattr(EngineHandle, "_wait", lambda self, future: wait(self, _InterruptedOnce(future)))
        installed = signal.getsignal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            worker.sync_params(scaled, in_flight=in_flight)
        monkeypatch.undo()
        assert signal.getsignal(signal.SIGINT) is installed  # put back
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert worker.weight_version == worker.engine.weight_version == version + 1
    served = worker.generate([PROMPT], max_new_tokens=4, temperature=0.0)
    assert served.weight_version == version + 1
    assert worker.sync_params(scaled).version == version + 2 == worker.engine.weight_version
    assert worker.generate([PROMPT], max_new_tokens=4, temperature=0.0).completions == served.completions
    worker.sync_params(params)
    assert worker.generate([PROMPT], max_new_tokens=4, temperature=0.0).completions == expected.completions


@pytest.mark.one_end
def test_a_cancel_storm_leaves_nothing_to_compile_or_wait_for(worker, chat_dir):
    """50 agenerate calls of varied shapes cancelled at varied moments while in-flight swaps
    run: afterwards no call, request or KV slot is left, and a drain sync on the warmed worker
    (its tree synced once: a tree's first sync compiles its plan, 2 programs) compiles nothing
    and waits for nothing."""
    import random

    params = load_hf_params(chat_dir)
    worker.sync_params(params)
    rng = random.Random(0)
    engine = worker.engine

    async def storm():
        async def cancelled_call(i):
            prompt = [rng.randrange(5, 300) for _ in range(rng.randrange(2, 40))]
            call = asyncio.ensure_future(
                worker.agenerate(
                    [prompt], n=rng.choice([1, 2, 4]), max_new_tokens=rng.randrange(4, 64), ignore_eos=True
                )
            )
            # Cancelled before admission, while queued, mid-prefill or mid-decode.
            for _ in range(i % 7):
                await asyncio.sleep(0)
            if i % 3:
                while engine.forward_count == start and not call.done():
                    await asyncio.sleep(0.001)
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call

        async def swaps():
            for _ in range(5):
                await asyncio.to_thread(worker.sync_params, params, in_flight=True)

        start = engine.forward_count
        await asyncio.gather(*(cancelled_call(i) for i in range(50)), swaps())

    asyncio.run(storm())
    wait_until(lambda: engine.requests_in_flight == 0 and worker.active_calls == 0)
    assert engine.testing.kv_tokens_held() == 0
    assert engine.testing.boundary_calls_queued == 0  # no swap left behind for the drain to wait on
    report = worker.sync_params(params)
    assert report.compiles == 0, report


@pytest.mark.one_end
def test_leaving_an_astream_aborts_its_rows_and_logs_nothing(worker, caplog):
    engine = worker.engine

    async def leave() -> int:
        stream = worker.astream([PROMPT, PROMPT[:2]], max_new_tokens=LONG, ignore_eos=True)
        async for _ in stream:
            break
        start = engine.forward_count
        await stream.aclose()
        return start

    with caplog.at_level(logging.ERROR):
        start = asyncio.run(leave())
        gc.collect()
    assert abandoned_forwards(worker, start) < LONG // 4
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


@pytest.mark.one_end
def test_a_client_leaving_a_stream_aborts_its_rows(http, worker, caplog):
    engine = worker.engine
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with caplog.at_level(logging.ERROR), http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        start = engine.forward_count
    assert abandoned_forwards(worker, start) < LONG // 4
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert complete(http).status_code == 200


@pytest.mark.one_end
def test_a_client_leaving_before_its_response_aborts_its_rows(server, worker, caplog):
    engine = worker.engine
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with caplog.at_level(logging.INFO, "rollout"):
        client = socket.create_connection(("127.0.0.1", server.port))
        client.sendall(head.encode() + body)
        wait_until(lambda: engine.requests_in_flight > 0)
        start = engine.forward_count
        client.close()
        assert abandoned_forwards(worker, start) < LONG // 4
        # The request's own log line: answered 499 (to nobody), no error on the way.
        wait_until(lambda: any("/v1/completions 499" in r.getMessage() for r in caplog.records))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
