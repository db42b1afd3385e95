"""The server's request parsing and error answers, with no engine: the app over a stub backend
(issue 34). Malformed bodies are 400s naming the field before anything reaches the worker; a
503 says why generation is paused; the start-up log names the served model."""

import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from rollout.batch import StreamChunk
from rollout.errors import InvalidRequest, LimitExceeded, WorkerClosed, WorkerUnavailable
from rollout.serve import parse_args
from rollout.server import Server, ServerConfig
from rollout.server.app import build_app
from rollout.server.backend import KV_HELD
from rollout.server.errors import api_error
from rollout.server.protocol import MAX_JSON_DEPTH, ApiError, parse_body

ADMIN = {"Authorization": "Bearer admin"}


class StubBackend:
    """:class:`rollout.server.Backend` with the tiny chat model's tokenizer and no engine: a
    request that reaches generate or stream is recorded and fails."""

    model_name = "chat"
    model_path = "/models/chat"
    context_length = 256
    max_request_tokens = 256
    weight_version = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.unavailable_reason = None
        self.kv_present = True
        self.reached = []

    async def generate(self, prompts, **sampling):
        self.reached.append(prompts)
        raise AssertionError("the request reached the backend")

    def stream(self, prompts, **sampling):
        self.reached.append(prompts)
        raise AssertionError("the request reached the backend")

    def adapter_names(self):
        return []

    def drop_kv(self):  # as WorkerBackend: held dropped
        self.kv_present, self.unavailable_reason = False, KV_HELD
        return {}

    def rebuild_kv(self):
        self.kv_present, self.unavailable_reason = True, None
        return {}


@pytest.fixture(scope="module")
def backend(chat_dir):
    return StubBackend(AutoTokenizer.from_pretrained(chat_dir))


@pytest.fixture(scope="module")
def http(backend):
    app = build_app(backend, ServerConfig(served_model_name="tiny", admin_token="admin"))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.fixture(autouse=True)
def fresh(backend):
    backend.reached.clear()
    backend.unavailable_reason = None
    yield
    assert not backend.reached, "a refused request reached the backend"


def post(http, path: str, body, headers=None) -> httpx.Response:
    """``body`` as JSON text (``json.dumps`` writes a lone surrogate as its ``\\ud800`` escape),
    or raw bytes."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"Content-Type": "application/json", **(headers or {})})


def error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# ---- text that is not valid Unicode ------------------------------------------------------------

BAD = "\ud800"  # a lone surrogate: valid JSON (as an escape), not valid Unicode
COMPLETION = {"model": "tiny", "prompt": "1+2=", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "1+2="}], "max_tokens": 2}
SURROGATES = [
    ("stop string", "/v1/completions", {**COMPLETION, "stop": BAD}, "stop"),
    ("stop list", "/v1/completions", {**COMPLETION, "stop": ["=", BAD]}, "stop[1]"),
    ("streamed stop list", "/v1/completions", {**COMPLETION, "stop": ["=", BAD], "stream": True}, "stop[1]"),
    ("chat stop string", "/v1/chat/completions", {**CHAT, "stop": BAD}, "stop"),
    ("chat stop list", "/v1/chat/completions", {**CHAT, "stop": [BAD]}, "stop[0]"),
    ("chat streamed stop", "/v1/chat/completions", {**CHAT, "stop": [BAD], "stream": True}, "stop[0]"),
    ("prompt string", "/v1/completions", {**COMPLETION, "prompt": "1" + BAD}, "prompt"),
    ("prompt list", "/v1/completions", {**COMPLETION, "prompt": ["1+2=", BAD]}, "prompt[1]"),
    (
        "message content",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": BAD}]},
        "messages[0].content",
    ),
    (
        "content part",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]},
        "messages[0].content[0].text",
    ),
    (
        "message role",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": BAD, "content": "hi"}]},
        "messages[0].role",
    ),
    ("model", "/v1/completions", {**COMPLETION, "model": BAD}, "model"),
    ("chat model", "/v1/chat/completions", {**CHAT, "model": BAD}, "model"),
    ("user", "/v1/completions", {**COMPLETION, "user": BAD}, "user"),
    ("chat user", "/v1/chat/completions", {**CHAT, "user": BAD}, "user"),
    (
        "an ignored field, nested",
        "/v1/chat/completions",
        {**CHAT, "metadata": {"tags": ["ok", BAD]}},
        "metadata.tags[1]",
    ),
    ("a key", "/v1/completions", {**COMPLETION, BAD: 1}, None),
    (
        "a nested key",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "hi", BAD: 1}]},
        "messages[0]",
    ),
    # Raw UTF-8 bytes of a surrogate (ED A0 80) decode to one as well.
    ("raw bytes", "/v1/completions", b'{"model": "tiny", "prompt": "1+2=", "stop": ["=", "\xed\xa0\x80"]}', "stop[1]"),
    ("admin reload path", "/admin/reload_weights", {"path": "/tmp/" + BAD, "format": "hf"}, "path"),
]


@pytest.mark.parametrize("path,body,param", [s[1:] for s in SURROGATES], ids=[s[0] for s in SURROGATES])
def test_text_that_is_not_valid_unicode_is_a_400_naming_the_field(http, path, body, param):
    found = error(post(http, path, body, headers=ADMIN), 400)
    assert found["param"] == param
    assert "not valid Unicode" in found["message"] and found["type"] == "invalid_request_error"
    if param is not None:
        assert found["message"].startswith(param + " ")


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/admin/reload_weights", {"path": "/tmp/model\x00", "format": "hf"}, "path"),
        ("/admin/load_lora", {"lora_path": "/tmp/\x00adapters"}, "lora_path"),
    ],
)
@pytest.mark.parametrize("reload_root", [None, "/tmp"])
def test_a_nul_in_an_admin_path_is_a_400_naming_the_field(backend, path, body, param, reload_root):
    """It was a 500 from the reload root's check (os.path.realpath raising ValueError)."""
    config = ServerConfig(served_model_name="tiny", admin_token="admin", reload_root=reload_root)
    with TestClient(build_app(backend, config), raise_server_exceptions=False) as client:
        found = error(post(client, path, body, headers=ADMIN), 400)
    assert found["param"] == param and "NUL" in found["message"]


@pytest.mark.parametrize("name", ["", "  ", 5])
def test_a_blank_or_non_string_adapter_name_is_a_400_naming_it(http, backend, name):
    """An empty name reached the worker, whose refusal was a 400 naming no field; a blank one
    was loaded under a name no request could pick out."""
    found = error(post(http, "/admin/load_lora", {"lora_path": "/tmp/adapters", "lora_name": name}, headers=ADMIN), 400)
    assert found["param"] == "lora_name" and "non-empty string" in found["message"]
    found = error(post(http, "/admin/unload_lora", {"lora_name": name}, headers=ADMIN), 400)
    assert found["param"] == "lora_name" and "non-empty string" in found["message"]


def test_health_and_ready_answer_head_probes_with_their_status(http, backend):
    assert http.head("/health").status_code == 200 and http.head("/ready").status_code == 200
    backend.unavailable_reason = "a train step is running"
    try:
        assert http.head("/ready").status_code == 503
    finally:
        backend.unavailable_reason = None


def test_a_chat_over_the_token_limit_without_max_tokens_is_told_the_default_it_got(backend):
    """The limit counts a chat's default (the rest of the context a row): the 413 named a field
    the client never sent."""
    config = ServerConfig(served_model_name="tiny", max_tokens_per_request=2000)
    with TestClient(build_app(backend, config), raise_server_exceptions=False) as client:
        unlimited = {key: value for key, value in CHAT.items() if key != "max_tokens"}
        found = error(post(client, "/v1/chat/completions", {**unlimited, "n": 16}), 413)
        assert found["param"] == "max_tokens"
        assert "with no max_tokens sent, a row may take the rest of the context: " in found["message"]
        sent = error(post(client, "/v1/chat/completions", {**unlimited, "n": 16, "max_tokens": 200}), 413)
        assert "no max_tokens sent" not in sent["message"]


UNSERVED = [
    ("echo", True, False),
    ("best_of", 2, 1),
    ("suffix", "x", ""),
    ("logit_bias", {"5": 10}, {}),
    ("presence_penalty", 0.5, 0.0),
    ("frequency_penalty", 0.5, 0),
    ("repetition_penalty", 1.1, 1.0),
    ("min_tokens", 4, 0),
    ("best_of", True, None),
    ("functions", [{"name": "f"}], []),
    # vLLM's and SGLang's extensions: a 200 would have carried unconstrained or other output.
    ("guided_json", {"type": "object"}, None),
    ("guided_choice", ["yes", "no"], None),
    ("regex", "[0-9]+", None),
    ("use_beam_search", True, False),
    ("include_stop_str_in_output", True, False),
    ("skip_special_tokens", False, True),
    ("bad_words", ["x"], []),
    ("prompt_logprobs", 0, None),
]


@pytest.mark.parametrize("path,base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("field,value,neutral", UNSERVED, ids=[f"{f}={v!r}" for f, v, _ in UNSERVED])
def test_a_field_the_worker_does_not_serve_is_refused_unless_neutral(http, backend, path, base, field, value, neutral):
    """A client's repetition_penalty or min_tokens (vLLM's, SGLang's), or frequency_penalty, was
    not applied: refused with a 400 naming it, rather than ignored (best_of: true passed as 1);
    its neutral value goes through."""
    found = error(post(http, path, {**base, field: value}), 400)
    assert found["param"] == field and found["message"] == f"'{field}' is not supported by this server"
    assert backend.reached == []
    post(http, path, {**base, field: neutral})
    assert len(backend.reached) == 1
    backend.reached.clear()  # reached on purpose


FORMATS = [
    ({"type": "json_object"}, "type 'json_object'"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}, "type 'json_schema'"),
    ("json", "'json'"),
]


@pytest.mark.parametrize("path,base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("response_format,shown", FORMATS, ids=["json_object", "json_schema", "a string"])
def test_a_response_format_the_output_would_have_to_follow_is_refused(
    http, backend, path, base, response_format, shown
):
    """JSON mode and schemas were accepted and ignored: a 200 whose text was not JSON, where the
    other fields that change the output are refused. Plain text goes through."""
    found = error(post(http, path, {**base, "response_format": response_format}), 400)
    assert found["param"] == "response_format" and f"'response_format' {shown} is not supported" in found["message"]
    assert backend.reached == []
    post(http, path, {**base, "response_format": {"type": "text"}})
    post(http, path, {**base, "response_format": {"type": "text", "strict": False}})
    assert len(backend.reached) == 2
    backend.reached.clear()  # reached on purpose


# ---- nesting -------------------------------------------------------------------------------------

DEEP = 100_000
NESTED = [
    ("lists, the whole body", b"[" * DEEP + b"]" * DEEP),
    ("objects, the whole body", b'{"a":' * DEEP + b"1" + b"}" * DEEP),
    ("lists in prompt", b'{"model": "tiny", "prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    ("objects in stop", b'{"model": "tiny", "prompt": "1", "stop": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}"),
    ("unclosed lists", b'{"model": "tiny", "prompt": ' + b"[" * DEEP),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/admin/reload_weights"])
@pytest.mark.parametrize("body", [n[1] for n in NESTED], ids=[n[0] for n in NESTED])
def test_deep_nesting_is_a_400_saying_the_body_is_malformed(http, path, body):
    found = error(post(http, path, body, headers=ADMIN), 400)
    assert found["param"] is None
    assert found["message"] == f"request body is malformed: it nests deeper than {MAX_JSON_DEPTH} levels"


def test_nesting_up_to_the_limit_is_parsed_and_brackets_in_strings_do_not_count(http):
    # The body is depth 1: stop's value fills the other levels and is then refused as a value.
    at_limit = {**COMPLETION, "stop": json.loads("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))}
    assert error(post(http, "/v1/completions", at_limit), 400)["param"] == "stop"
    over = {**COMPLETION, "stop": json.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)}
    assert error(post(http, "/v1/completions", over), 400)["param"] is None
    # Brackets, quotes and backslashes inside strings are text.
    model = '[{\\"' * DEEP
    assert error(post(http, "/v1/completions", {**COMPLETION, "model": model}), 404)["code"] == "model_not_found"
    # Still malformed JSON: a 400 saying so.
    assert (
        "not valid JSON" in error(post(http, "/v1/completions", b'{"model": "tiny", "prompt": [1, 2'), 400)["message"]
    )


@pytest.mark.parametrize("digits", [1001, 5001])
def test_an_integer_no_field_takes_is_named_as_such_not_as_invalid_json(digits):
    """Past 4300 digits Python's int() refused it, and the 400 read "not valid JSON: Exceeds the
    limit ... use sys.set_int_max_str_digits()"."""
    with pytest.raises(ApiError) as refused:
        parse_body(b'{"model": "tiny", "prompt": "1", "max_tokens": -' + b"9" * digits + b"}")
    assert refused.value.status == 400
    assert refused.value.message == (
        f"request body holds an integer of {digits} digits: no field takes one over 1000 digits long"
    )
    assert parse_body(b'{"seed": ' + b"9" * 1000 + b"}")["seed"] == int("9" * 1000)


@pytest.mark.parametrize("tail", [b"", b"\\", b"[[{"], ids=["end", "lone backslash", "brackets"])
def test_an_unterminated_string_of_escaped_quotes_is_refused_in_one_pass(tail):
    """A string left open, full of escaped quotes: the depth scan once restarted at each quote
    and scanned to the end, so a 1 MiB body held the event loop for about an hour. Run on a
    thread given a minute (a linear scan takes milliseconds), so a regression fails, not hangs."""
    body = b'{"model": "tiny", "prompt": "' + b'\\"' * 500_000 + tail
    outcome = []

    def parse():
        try:
            parse_body(body)
        except ApiError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=parse, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the body's scan is not linear"
    (refused,) = outcome
    assert refused.status == 400 and "not valid JSON" in refused.message


# ---- the other fields ------------------------------------------------------------------------------


def test_a_model_that_is_not_a_string_is_a_400(http):
    assert error(post(http, "/v1/completions", {**COMPLETION, "model": ["tiny"]}), 400)["param"] == "model"


@pytest.mark.parametrize("value", [1, 2, 5, 6, -1, 2.5, True, "0"])
def test_every_refused_logprobs_gets_one_truthful_message(http, value):
    found = error(post(http, "/v1/completions", {**COMPLETION, "logprobs": value}), 400)
    assert found["param"] == "logprobs"
    assert (
        found["message"] == f"'logprobs' must be 0 or null: only the sampled token's log-prob is returned, "
        f"no top alternatives (got {value!r})"
    )


@pytest.mark.parametrize("value", [1, 20, 21, -1, "0"])
def test_every_refused_top_logprobs_gets_one_truthful_message(http, value):
    found = error(post(http, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": value}), 400)
    assert found["param"] == "top_logprobs"
    assert (
        found["message"] == f"'top_logprobs' must be 0 or null: only the sampled token's log-prob is returned, "
        f"no top alternatives (got {value!r})"
    )


HUGE = 10**400  # an integer JSON allows and no float holds (its conversion raised OverflowError, a 500)
NUMBERS = [
    ("temperature", "/v1/completions", {**COMPLETION, "temperature": HUGE}),
    ("temperature", "/v1/chat/completions", {**CHAT, "temperature": -HUGE}),
    ("top_p", "/v1/completions", {**COMPLETION, "top_p": HUGE}),
    ("scale", "/admin/perturb_weights", {"scale": HUGE}),
]


@pytest.mark.parametrize("param,path,body", NUMBERS, ids=[f"{n[0]} {n[1]}" for n in NUMBERS])
def test_an_integer_past_floats_range_is_a_400_naming_the_field(http, param, path, body):
    found = error(post(http, path, body, headers=ADMIN), 400)
    assert found["param"] == param and found["message"].startswith(f"'{param}' must be a number")
    assert len(found["message"]) < 150  # the value shown cut short, not its 401 digits


@pytest.mark.parametrize("value", [[], 0, False, ""])
def test_stream_options_that_are_not_an_object_are_a_400(http, value):
    found = error(post(http, "/v1/completions", {**COMPLETION, "stream": True, "stream_options": value}), 400)
    assert found["param"] == "stream_options" and found["message"] == "'stream_options' must be an object"


WORDED = [
    (
        "prompt",
        InvalidRequest("prompts[3]", "prompts[3] has 900 tokens; the engine accepts prompts of at most 256"),
        "prompt",
        "prompt[3] has 900 tokens; the engine accepts prompts of at most 256",
    ),
    (
        "messages",
        InvalidRequest("max_new_tokens", "prompts[0] has 90 tokens and max_new_tokens=200: 290 do not fit"),
        "max_tokens",
        "the chat template's rendering of messages has 90 tokens and max_tokens=200: 290 do not fit",
    ),
    (
        "prompt",
        LimitExceeded("prompts", "prompts", 300, "ServerConfig.max_prompts_per_request", 64),
        "prompt",
        "the request asks for 300 prompts, more than ServerConfig.max_prompts_per_request=64",
    ),
]


@pytest.mark.parametrize("prompt_field,exc,param,message", WORDED, ids=["prompt", "chat", "limit"])
def test_the_workers_words_become_the_requests(prompt_field, exc, param, message):
    """Its prompts[i] is the request's prompt[i], or a chat's rendered messages (one prompt, not
    messages[0]); "prompts" as a word stays English."""
    error = api_error(exc, prompt_field=prompt_field)
    assert (error.param, error.message) == (param, message)


# ---- 503s ------------------------------------------------------------------------------------------

# The worker's reasons (RolloutWorker.unavailable_reason, WorkerUnavailable.reason) -> code, words.
REASONS = [
    (
        "a train step is running",
        "released_for_training",
        "the KV cache is released for training (a train step is running)",
    ),
    (
        "a train step ran since the last sync_params",
        "released_for_training",
        "the KV cache is released for training (a train step ran since the last sync_params)",
    ),
    ("weights are being swapped", "weights_updating", "weights are being swapped"),
    ("weights are being reloaded", "weights_updating", "weights are being reloaded"),
    ("weights are being perturbed", "weights_updating", "weights are being perturbed"),
    ("the KV cache is being dropped", "kv_cache_updating", "the KV cache is being dropped"),
    ("the KV cache is being rebuilt", "kv_cache_updating", "the KV cache is being rebuilt"),
    ("the weights of engine 1 were freed", "weights_freed", "the weights of engine 1 were freed"),
    ("something new", "unavailable", "something new"),
]


@pytest.mark.parametrize("reason,code,words", REASONS, ids=[r[1] + ": " + r[0] for r in REASONS])
def test_a_paused_worker_is_a_503_saying_why(http, backend, reason, code, words):
    backend.unavailable_reason = reason
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", {**CHAT, "stream": True})):
        response = post(http, path, body)
        found = error(response, 503)
        assert found["code"] == code and found["type"] == "service_unavailable"
        assert words in found["message"] and "retry" in found["message"]
        assert response.headers["retry-after"] == "1"
    # Raised by the worker once admitted: the same answer.
    assert api_error(WorkerUnavailable(reason, f"{reason}: details")).body()["error"]["code"] == code


def test_a_closed_worker_is_a_503_without_retry_after(http, backend):
    backend.unavailable_reason = "the worker is closed"
    response = post(http, "/v1/completions", COMPLETION)
    found = error(response, 503)
    assert found["code"] == "worker_closed" and "shutting down" in found["message"]
    assert "retry-after" not in response.headers
    assert api_error(WorkerClosed()).code == "worker_closed"


def test_a_kv_cache_dropped_through_admin_is_a_503_saying_so(http, backend):
    assert post(http, "/admin/drop_kv", {}, headers=ADMIN).status_code == 200
    try:
        found = error(post(http, "/v1/completions", COMPLETION), 503)
        assert found["code"] == "kv_cache_dropped" and "/admin/rebuild_kv" in found["message"]
    finally:
        assert post(http, "/admin/rebuild_kv", {}, headers=ADMIN).status_code == 200


# ---- start-up ----------------------------------------------------------------------------------


def test_the_start_up_log_names_the_served_model_and_its_path(backend, caplog):
    with (
        caplog.at_level(logging.INFO, "rollout.server"),
        Server(backend, ServerConfig(port=0, served_model_name="qwen")) as server,
    ):
        url = server.url
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("serving"))
    assert line == f"serving model 'qwen' (from /models/chat) on {url}"


class NeverEndingBackend(StubBackend):
    """Requests that run until cancelled: a generate that never returns, a stream that sends
    one chunk and then nothing (``started`` is set when a request reaches either)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.started = threading.Event()

    async def generate(self, prompts, **sampling):
        self.started.set()
        await asyncio.Event().wait()

    async def stream(self, prompts, **sampling):
        yield StreamChunk(0, 0, 0, [5], None, weight_version=0)
        self.started.set()
        await asyncio.Event().wait()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_request_that_outlives_the_drain_timeout_gets_a_503_saying_the_server_stopped(backend, stream):
    """uvicorn cancels it (it answered a plain-text 500): a JSON 503 worker_closed, or, once its
    stream began, that error as the stream's last event."""
    never_ending = NeverEndingBackend(backend.tokenizer)
    server = Server(never_ending, ServerConfig(port=0, served_model_name="tiny", drain_timeout_s=0.1))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            httpx.post, server.url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=60
        )
        assert never_ending.started.wait(timeout=60)
        server.close()
        response = answer.result()
    if stream:
        assert response.status_code == 200
        last = json.loads(response.text.strip().split("\n\n")[-1].removeprefix("data: "))
    else:
        assert response.status_code == 503 and response.headers["content-type"] == "application/json"
        last = response.json()
    assert last["error"]["code"] == "worker_closed" and "drain timeout" in last["error"]["message"]


class HeldBackend(StubBackend):
    """A generate that runs until ``release`` is set (``started`` is set when one begins)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.started, self.release = threading.Event(), threading.Event()

    async def generate(self, prompts, **sampling):
        self.started.set()
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        raise RuntimeError("released")


class LogEvent(logging.Handler):
    def __init__(self, words: str):
        super().__init__()
        self.words, self.seen = words, threading.Event()

    def emit(self, record):
        if self.words in record.getMessage():
            self.seen.set()


def test_a_second_sigint_stops_the_drain_even_where_sigint_was_inherited_ignored(backend):
    """A server started in the background of a shell inherits SIGINT ignored: the first SIGINT
    drains, the second stops at once (it was ignored and the drain ran to its end)."""
    held = HeldBackend(backend.tokenizer)
    server = Server(held, ServerConfig(port=0, served_model_name="tiny", drain_timeout_s=60))
    draining = LogEvent("draining running requests")
    runner_log = logging.getLogger("rollout.server.runner")
    level = runner_log.level
    runner_log.setLevel(logging.INFO)
    runner_log.addHandler(draining)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def interrupt_twice():
        assert held.started.wait(timeout=60)
        os.kill(os.getpid(), signal.SIGINT)
        assert draining.seen.wait(timeout=60)
        os.kill(os.getpid(), signal.SIGINT)

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            request = pool.submit(httpx.post, server.url + "/v1/completions", json=COMPLETION, timeout=60)
            signals = pool.submit(interrupt_twice)
            with pytest.raises(KeyboardInterrupt):
                server.wait()
            signals.result()
            # Cut short: the request is still held (only its release or the 60 s drain ends it).
            # (Thread.is_alive cannot say: a join interrupted by Ctrl-C marks the thread stopped.)
            assert not request.done()
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # put back
            held.release.set()
    finally:
        signal.signal(signal.SIGINT, before)
        runner_log.removeHandler(draining)
        runner_log.setLevel(level)
        held.release.set()
        server.close()


def test_a_sigterm_repeated_while_the_worker_closes_after_the_drain_lets_it_finish(backend):
    """``wait(then=worker.close)``: a supervisor repeating SIGTERM once the drain is over, while
    the engine stops, is let be (``python -m rollout.serve`` was killed there, exit -15); the
    handlers are put back after."""
    server = Server(backend, ServerConfig(port=0, served_model_name="tiny"))
    let_be = LogEvent("SIGTERM while draining")
    runner_log = logging.getLogger("rollout.server.runner")
    level = runner_log.level
    runner_log.setLevel(logging.INFO)
    runner_log.addHandler(let_be)
    terminated = threading.Event()

    def own_handler(*_):
        terminated.set()

    before = signal.signal(signal.SIGTERM, own_handler)
    closed = []

    def close_worker():
        os.kill(os.getpid(), signal.SIGTERM)
        assert let_be.seen.wait(timeout=60)
        closed.append(True)

    try:
        threading.Thread(target=server.close).start()  # wait() then drains as after a signal
        server.wait(then=close_worker)
        assert closed == [True] and not terminated.is_set()
        assert signal.getsignal(signal.SIGTERM) is own_handler  # put back
        os.kill(os.getpid(), signal.SIGTERM)
        assert terminated.wait(timeout=60)
    finally:
        signal.signal(signal.SIGTERM, before)
        runner_log.removeHandler(let_be)
        runner_log.setLevel(level)
        server.close()


class HeldTokenizer:
    """The chat tokenizer, except that encoding ``HELD`` waits until released (a prompt that
    takes long to tokenize), then refuses it."""

    HELD = "a prompt held in its tokenizer"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, text, **kwargs):
        if text == self.HELD:
            self.entered.set()
            self.release.wait()
            raise InvalidRequest("prompt", "released")
        return self.tokenizer.encode(text, **kwargs)


def test_tokenizing_a_prompt_holds_up_no_other_request(backend):
    """Prompts are encoded (and chat templates rendered) off the event loop: a megabyte prompt
    held it 2 s, every other client's stream and /health with it."""
    tokenizer = HeldTokenizer(backend.tokenizer)
    server = Server(StubBackend(tokenizer), ServerConfig(port=0, served_model_name="tiny"))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(
                httpx.post, server.url + "/v1/completions", json={**COMPLETION, "prompt": tokenizer.HELD}
            )
            assert tokenizer.entered.wait(timeout=60)
            try:
                health = httpx.get(server.url + "/health", timeout=30)  # a bound for the failure only
            finally:
                tokenizer.release.set()
            assert health.status_code == 200
            assert held.result().status_code == 400
    finally:
        tokenizer.release.set()
        server.close()


def test_a_client_that_leaves_while_sending_its_body_is_no_server_error(backend):
    """Its request is logged as 499 (it was an "unexpected error" with two tracebacks)."""
    records, logged = [], threading.Event()

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record)
            if record.name == "rollout.server.app" and "POST /v1/completions" in record.getMessage():
                logged.set()

    handler, loggers = Capture(), [logging.getLogger("rollout.server"), logging.getLogger("uvicorn.error")]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.addHandler(handler)
        each.setLevel(logging.INFO)
    server = Server(StubBackend(backend.tokenizer), ServerConfig(port=0, served_model_name="tiny"))
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as connection:
            connection.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                b'Content-Length: 500\r\n\r\n{"model": "tiny", '
            )
        assert logged.wait(timeout=60)
    finally:
        server.close()
        for each, level in zip(loggers, levels):
            each.removeHandler(handler)
            each.setLevel(level)
    assert not [r.getMessage() for r in records if r.levelno >= logging.ERROR]
    assert any(" 499 " in r.getMessage() for r in records if r.name == "rollout.server.app")


STALLED_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    b"Content-Length: 500\r\nExpect: 100-continue\r\n\r\n"
)


def read_answer(answers) -> tuple[int, dict, bytes]:
    """The status, headers and body of the next answer on a connection's ``makefile("rb")``."""
    status = int(answers.readline().split()[1])
    headers = {}
    while (line := answers.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.lower()] = value.strip()
    return status, headers, answers.read(int(headers.get("content-length", 0)))


def test_a_body_that_stalls_is_a_408_that_closes_the_connection(backend):
    """A client that sent part of its body and stopped held its connection for good (uvicorn has
    no body timeout; its keep-alive timeout runs only between requests)."""
    server = Server(StubBackend(backend.tokenizer), ServerConfig(port=0, served_model_name="tiny", body_timeout_s=0.5))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as connection:
            connection.sendall(STALLED_HEAD + b'{"model": "tiny", ')
            answers = connection.makefile("rb")
            assert read_answer(answers)[0] == 100  # the route is reading the body
            status, headers, body = read_answer(answers)
            assert status == 408 and headers["connection"] == "close"
            assert json.loads(body)["error"]["message"] == (
                "the request body did not arrive whole within 0.5 s (ServerConfig.body_timeout_s)"
            )
            assert answers.read() == b""  # closed by the server
    finally:
        server.close()


def head_timeout_server(backend) -> Server:
    return Server(StubBackend(backend.tokenizer), ServerConfig(port=0, served_model_name="tiny", header_timeout_s=0.5))


def test_a_connection_whose_request_head_does_not_arrive_is_closed_at_the_header_timeout(backend):
    """uvicorn's keep-alive timer starts only after a response: a client that connected and sent
    nothing, or part of a head, held its connection (and a file descriptor) until shutdown. One
    that sent nothing is closed without an answer, as an idle keep-alive connection is."""
    server = head_timeout_server(backend)
    try:
        start = time.monotonic()  # before the server's connection_made, which starts the deadline
        with (
            socket.create_connection(("127.0.0.1", server.port), timeout=60) as silent,
            socket.create_connection(("127.0.0.1", server.port), timeout=60) as partial,
        ):
            partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-")
            assert silent.recv(1) == b""
            assert time.monotonic() - start > 0.45  # the deadline (0.5 s), not at once
            answers = partial.makefile("rb")
            status, headers, body = read_answer(answers)
            assert status == 408 and headers["connection"] == "close"
            assert json.loads(body)["error"] == {
                "message": "the request head (request line and headers) did not arrive whole within 0.5 s "
                "(ServerConfig.header_timeout_s)",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
            assert answers.read() == b""
    finally:
        server.close()


def trickle_until_closed(connection: socket.socket) -> bytes:
    """Sends a request head a byte at a time (one each 50 ms without an answer) until the
    server closes the connection; what it answered before closing."""
    connection.settimeout(0.05)
    connection.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Slow: ")
    answer, give_up = b"", time.monotonic() + 30
    while time.monotonic() < give_up:
        try:
            if not answer:
                connection.sendall(b"a")
            chunk = connection.recv(4096)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):  # closed as a byte was on its way
            return answer
        if not chunk:
            return answer
        answer += chunk
    pytest.fail("a head trickled for 30 s was never cut off")


def test_a_request_head_trickled_byte_by_byte_is_cut_at_the_header_timeout(backend):
    """A deadline on the whole head, not on the gaps between its bytes (each far shorter than
    the deadline), timed from the connection's opening and, on a kept-alive connection, from
    the next request's first byte: uvicorn's keep-alive timer stops at that byte."""
    server = head_timeout_server(backend)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as fresh:
            answer = trickle_until_closed(fresh)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
            assert read_answer(kept.makefile("rb"))[0] == 200
            answer = trickle_until_closed(kept)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
    finally:
        server.close()


def test_the_next_head_is_timed_after_an_early_answer_and_behind_a_pipelined_request(backend):
    """A route that answers before reading the body (a 404): the body's last bytes end the
    request after its response, where uvicorn had cancelled its keep-alive timer, and neither
    timer ran: a silent client, or one that sent part of its next head, held the connection.
    A head begun behind a pipelined request was timed by the keep-alive timer (75 s)."""
    server = head_timeout_server(backend)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
            answers = connection.makefile("rb")
            connection.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\nGET /health HTTP/1.1\r\nHo")
            assert read_answer(answers)[0] == 200
            rest = answers.read()
            assert rest.startswith(b"HTTP/1.1 408 "), rest
        # The body whole then silence, or then part of the next head; or only part of the body.
        for after_answer in (b"{}", b"{}GET /health HTTP/1.1\r\nHo", b"{"):
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
                answers = connection.makefile("rb")
                connection.sendall(b"POST /no-such-route HTTP/1.1\r\nHost: test\r\nContent-Length: 2\r\n\r\n")
                assert read_answer(answers)[0] == 404
                connection.sendall(after_answer)
                rest = answers.read()  # until the server closes it (a socket timeout fails the test)
                assert rest == b"" or rest.startswith(b"HTTP/1.1 408 "), rest
    finally:
        server.close()


def test_a_keep_alive_connection_idle_longer_than_the_header_timeout_serves_its_next_request(backend):
    """The silence between requests is the keep-alive timeout's (75 s), not the head's."""
    server = head_timeout_server(backend)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as connection:
            answers = connection.makefile("rb")
            connection.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
            assert read_answer(answers)[0] == 200
            connection.settimeout(1.0)  # twice the header timeout: nothing comes, the connection stays
            with pytest.raises(TimeoutError):
                connection.recv(1)
            connection.settimeout(60)
            connection.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
            assert read_answer(answers)[0] == 200
    finally:
        server.close()


def test_a_body_still_arriving_when_the_drain_begins_is_answered_at_once(backend):
    """No work of the request has begun: it was held until the drain timeout passed (30 s by
    default), holding up the server's stop."""
    server = Server(StubBackend(backend.tokenizer), ServerConfig(port=0, served_model_name="tiny", drain_timeout_s=60))
    closing = threading.Thread(target=server.close)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as connection:
            connection.sendall(STALLED_HEAD + b'{"model": "tiny", ')
            answers = connection.makefile("rb")
            assert read_answer(answers)[0] == 100  # the route is reading the body
            closing.start()
            status, headers, body = read_answer(answers)
            assert status == 503 and headers["connection"] == "close" and "retry-after" not in headers
            error = json.loads(body)["error"]
            assert error["code"] == "worker_closed"
            assert error["message"] == "the server is shutting down: its drain began before the request's body was read"
            assert answers.read() == b""
        closing.join(timeout=60)
        assert not closing.is_alive()
    finally:
        server.close()


def test_a_request_that_reaches_its_body_after_the_drain_began_is_refused(backend):
    """One whose headers came as the drain began, its route not yet reading: refused, where a
    stalled body would have held the drain."""
    app = build_app(backend, ServerConfig(served_model_name="tiny"))
    app.state.begin_drain()
    with TestClient(app) as client:
        response = post(client, "/v1/completions", COMPLETION)
    assert error(response, 503)["code"] == "worker_closed" and response.headers["connection"] == "close"


def test_an_unexpected_error_is_a_500_logged_once_with_its_status_and_the_connection_serves_on(backend):
    """It was answered by Starlette's outermost middleware and re-raised: uvicorn logged a second
    traceback and closed the keep-alive connection (a client's next request on it could be
    reset), and the request log read status 0. A path's control characters are escaped there."""
    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler, loggers = Capture(), [logging.getLogger("rollout.server"), logging.getLogger("uvicorn.error")]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.addHandler(handler)
        each.setLevel(logging.INFO)
    # The stub has no memory(): an AttributeError, as any bug in a route would raise.
    server = Server(StubBackend(backend.tokenizer), ServerConfig(port=0, served_model_name="tiny", admin_token="admin"))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as connection:
            answers = connection.makefile("rb")

            def ask(path: str) -> tuple[int, bytes]:
                connection.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer admin\r\n\r\n".encode())
                status = int(answers.readline().split()[1])
                length = 0
                while (line := answers.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode().partition(":")
                    length = int(value) if name.lower() == "content-length" else length
                return status, answers.read(length)

            status, body = ask("/admin/memory")
            assert status == 500 and b"internal error (request id req-" in body
            assert ask("/health")[0] == 200  # the same connection
            assert ask("/v1/models/x%0A2026-12-01%20fake%20line")[0] == 404
    finally:
        server.close()
        for each, level in zip(loggers, levels):
            each.removeHandler(handler)
            each.setLevel(level)
    errors = [r for r in records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].name == "rollout.server.errors" and errors[0].exc_info
    lines = [r.getMessage() for r in records if r.name == "rollout.server.app"]
    assert any(line.startswith("GET /admin/memory 500 ") for line in lines)
    assert any(line.startswith("GET /v1/models/x\\n2026-12-01 fake line 404 ") for line in lines)


def test_a_flag_value_the_configs_refuse_is_a_usage_error_naming_it(tmp_path, capsys):
    """It was a traceback (the config's ValueError)."""
    for flags, words in (
        (["--port", "70000"], "ServerConfig.port must be an int in [0, 65535], got 70000"),
        (["--admin-token", ""], "ServerConfig.admin_token must be a non-empty string"),
        (["--reload-root", str(tmp_path / "missing")], "reload_root must be an existing directory"),
        (["--body-timeout-s", "0"], "ServerConfig.body_timeout_s must be > 0, got 0.0"),
        (["--header-timeout-s", "-1"], "ServerConfig.header_timeout_s must be > 0, got -1.0"),
    ):
        with pytest.raises(SystemExit) as exited:
            parse_args(["--model-path", str(tmp_path), *flags])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage:") and words in err and "Traceback" not in err


class QueuedBackend(StubBackend):
    """A stream whose rows wait for admission until cancelled: ``started`` when a request
    reaches it, ``closed`` when it is closed before its first chunk."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.started, self.closed = threading.Event(), threading.Event()

    async def stream(self, prompts, **sampling):
        self.started.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.closed.set()
        yield  # an async generator that never reaches its first chunk


def test_a_client_leaving_a_stream_before_its_first_chunk_closes_it_and_is_logged_499(backend):
    """The handler awaited the first chunk before answering, watching no disconnect: a client
    that gave up while its rows queued left them to be admitted and prefilled for nobody, and
    its request was logged 200."""
    queued = QueuedBackend(backend.tokenizer)
    logged = LogEvent("POST /v1/completions 499")
    logging.getLogger("rollout.server").addHandler(logged)
    level = logging.getLogger("rollout.server").level
    logging.getLogger("rollout.server").setLevel(logging.INFO)
    server = Server(queued, ServerConfig(port=0, served_model_name="tiny"))
    try:
        body = json.dumps({**COMPLETION, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as connection:
            connection.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert queued.started.wait(timeout=60)
        assert queued.closed.wait(timeout=60)
        assert logged.seen.wait(timeout=60)
    finally:
        server.close()
        logging.getLogger("rollout.server").removeHandler(logged)
        logging.getLogger("rollout.server").setLevel(level)
