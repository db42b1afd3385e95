"""HTTP server mode: a real server on a loopback port, called with the openai client and httpx."""

import asyncio
import logging
import signal
import threading
import time

import httpx
import jax
import openai
import orbax.checkpoint as ocp
import pytest

from bench.serve_load import ADMIN_TOKEN, run_load
from rollout import RolloutWorker
from rollout.chat import parse_tool_calls, render_chat
from rollout.server import Server, ServerConfig, WorkerBackend
from tests.helpers import admitted_together, held_mid_call, serve_process, tiny_worker_config
from trainer_bridge import load_hf_params

API_KEY = "sk-test"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROMPT = [5, 17, 42, 8]


@pytest.fixture(scope="module")
def worker(chat_dir):
    with RolloutWorker(tiny_worker_config(chat_dir)) as w:
        yield w


@pytest.fixture(scope="module")
def server(worker):
    with worker.serve(admin_token=ADMIN_TOKEN, api_key=API_KEY, served_model_name="tiny") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def original_checkpoint(chat_dir, tmp_path_factory):
    """The model's own weights as an orbax checkpoint."""
    path = tmp_path_factory.mktemp("ckpt") / "original"
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, jax.tree_util.tree_map(jax.device_put, load_hf_params(chat_dir)))
    checkpointer.wait_until_finished()
    return str(path)


def checksum(http) -> dict:
    response = http.get("/admin/weights_checksum", headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


def complete(http, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **body})


# ---- OpenAI routes ---------------------------------------------------------------------------


@pytest.mark.one_end
def test_models_and_health(client, http):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").status_code == 200


@pytest.mark.one_end
def test_greedy_completion_equals_worker_generate(client, worker):
    expected = worker.generate(["hello world"], temperature=0.0, max_new_tokens=8, ignore_eos=True)
    response = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0)
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] == expected.completions[0]
    assert choice.text == expected.completion_texts[0]
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompts[0])
    assert response.usage.completion_tokens == 8
    assert response.model_extra["weight_version"] == worker.weight_version
    # Token-id prompts and a list of prompts: prompt-major choices.
    batch = client.completions.create(model="tiny", prompt=[PROMPT, expected.prompts[0]], max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[1].model_extra["token_ids"] == expected.completions[0]


@pytest.mark.one_end
def test_top_k_min_p_and_stop_token_ids_are_the_workers(client, worker):
    """The vLLM extensions sample as the worker does (they were taken and ignored)."""
    options = dict(max_new_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    for extra in (dict(top_k=1), dict(top_k=3, min_p=0.2)):
        expected = worker.generate([PROMPT], **options, **extra).completions[0]
        body = dict(ignore_eos=True, **extra)
        response = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, extra_body=body
        )
        assert response.choices[0].model_extra["token_ids"] == expected, extra
    full = worker.generate([PROMPT], temperature=0.0, max_new_tokens=8, ignore_eos=True).completions[0]
    stop = full[3]
    body = dict(stop_token_ids=[stop], ignore_eos=True)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body=body)
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] == full[: full.index(stop) + 1]  # kept, as the model's EOS is
    assert choice.finish_reason == "stop"


@pytest.mark.one_end
def test_n_samples_and_seed(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=7)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    ids = [c.model_extra["token_ids"] for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({tuple(i) for i in ids}) == 3
    assert [c.model_extra["token_ids"] for c in again.choices] == ids
    assert first.usage.completion_tokens == sum(map(len, ids))


@pytest.mark.one_end
def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0).choices[0]
    stop = full.text[2:4]
    cut = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=8, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop"


@pytest.mark.one_end
def test_chat_completion_uses_the_chat_template(client, worker):
    messages = [{"role": "user", "content": "1+2="}]
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    tokenizer = worker.tokenizer
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    expected = worker.generate([prompt_ids], temperature=0.0, max_new_tokens=6)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.completion_texts[0]
    assert response.usage.prompt_tokens == len(prompt_ids)


@pytest.mark.one_end
def test_streaming_matches_the_non_streamed_result(client):
    plain = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0)
    chunks = list(
        client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts == {0: chat.choices[0].message.content, 1: chat.choices[0].message.content}
    assert finish == {0: chat.choices[0].finish_reason, 1: chat.choices[0].finish_reason}
    assert usage.completion_tokens == 2 * chat.usage.completion_tokens


@pytest.mark.one_end
def test_log_probs_are_the_engines(client, worker):
    kwargs = dict(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=9, return_logprobs=True)
    expected = worker.generate([PROMPT], **kwargs)
    values = expected.logprobs[0, expected.prompt_width :][: len(expected.completions[0])].tolist()
    request = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=9, logprobs=0)
    response = client.completions.create(**request)
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] == expected.completions[0]
    assert choice.logprobs.token_logprobs == pytest.approx(values, abs=1e-6)
    assert len(choice.logprobs.tokens) == 6 and all(v <= 0 for v in values)
    streamed = []
    for chunk in client.completions.create(**request, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.token_logprobs)
    assert streamed == pytest.approx(values, abs=1e-6)
    messages = [{"role": "user", "content": "1+2="}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0, logprobs=True)
    assert len(chat.choices[0].logprobs.content) == 4
    assert all(entry.logprob <= 0 for entry in chat.choices[0].logprobs.content)


@pytest.mark.one_end
def test_streaming_cuts_at_a_stop_string(client):
    full = client.completions.create(model="tiny", prompt="hello world", max_tokens=12, temperature=0).choices[0]
    stop = full.text[3:5]
    expected = full.text[: full.text.index(stop)]
    chunks = list(
        client.completions.create(
            model="tiny", prompt="hello world", max_tokens=12, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.one_end
def test_a_client_leaving_a_stream_frees_its_call(http, worker):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    assert complete(http, **body).json()["choices"][0]["finish_reason"] == "length"
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert worker.active_calls == 1  # still generating when the client leaves
    deadline = time.monotonic() + 60
    while worker.active_calls and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.active_calls == 0
    assert complete(http).status_code == 200


@pytest.mark.one_end
def test_concurrent_requests_are_batched_by_the_engine(server, worker):
    body = {"model": "tiny", "max_tokens": 24, "temperature": 1.0, "seed": 5}
    engine = worker.engine

    async def post(client, prompt):
        response = await client.post("/v1/completions", json={**body, "prompt": prompt})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    async def send(prompts):
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=headers) as client:
            return await asyncio.gather(*(post(client, p) for p in prompts))

    prompts = [[5 + i, 17, 42, 8] for i in range(6)]
    start = engine.forward_count
    alone = asyncio.run(send(prompts[:1]))
    one = engine.forward_count - start
    start = engine.forward_count
    with admitted_together(worker, requests=len(prompts)):
        together = asyncio.run(send(prompts))
    six = engine.forward_count - start
    # Serialized requests would take about six times the forwards of one.
    assert six < 2 * one, (six, one)
    assert together[0] == alone[0]


# ---- tools and the prefix cache --------------------------------------------------------------------

# One tool, few words: the template's tool turn, a user turn and a tool turn fill most of the
# 256-token context (the tiny tokenizer spends about a token per character).
ADD_TOOL = [{"type": "function", "function": {"name": "add"}}]


@pytest.mark.one_end
def test_chat_with_tools_reports_the_prompt_tokens_the_engine_found_cached(client, worker):
    """Tools and a tool message are rendered with the model's template and answered; a request
    extending an earlier conversation reports in usage the prompt tokens the engine found in its
    prefix cache, streamed and not. (The tool-call replies themselves: tests/unit/test_chat.py.)"""
    tokenizer = worker.tokenizer

    def prompt_ids(messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = render_chat(tokenizer, messages, tools=ADD_TOOL, add_generation_prompt=add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=False)

    request = dict(model="tiny", tools=ADD_TOOL, max_tokens=4, temperature=0)
    asked = [{"role": "user", "content": "1+2="}]
    answered = asked + [{"role": "tool", "tool_call_id": "call_0", "content": "3"}]
    first = client.chat.completions.create(messages=asked, **request)
    second = client.chat.completions.create(messages=answered, **request)
    first_ids, second_ids = prompt_ids(asked), prompt_ids(answered)
    assert (first.usage.prompt_tokens, second.usage.prompt_tokens) == (len(first_ids), len(second_ids))
    # The second prompt is the first's up to the turn after the user's (the tool's response,
    # where the first prompt opened the assistant's): the engine found that much cached.
    shared = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b)
    assert shared == len(prompt_ids(asked, add_generation_prompt=False)) + 1  # and the next turn's <|im_start|>
    assert first.usage.prompt_tokens_details.cached_tokens < shared
    assert second.usage.prompt_tokens_details.cached_tokens == shared
    # A new question with n > 1: what the cache held before it (the framing it shares with the
    # first), though its samples found the whole prompt that the request itself prefilled once.
    other = [{"role": "user", "content": "4+0="}]
    third = client.chat.completions.create(messages=other, n=3, **(request | {"temperature": 1.0}))
    other_ids = prompt_ids(other)
    framing = next(i for i, (a, b) in enumerate(zip(first_ids, other_ids)) if a != b)
    assert third.usage.prompt_tokens_details.cached_tokens == framing < len(other_ids) - 1

    # Again, streamed: all of it is cached but the last token, which the engine computes.
    chunks = list(
        client.chat.completions.create(
            messages=answered, stream=True, stream_options={"include_usage": True}, **request
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(second_ids) - 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == second.choices[0].message.content
    expected = worker.generate([second_ids], temperature=0.0, max_new_tokens=4)
    assert expected.cached_tokens.tolist() == [len(second_ids) - 1]
    assert second.choices[0].message.content == parse_tool_calls(expected.completion_texts[0]).content
    assert second.choices[0].message.tool_calls is None


@pytest.mark.one_end
def test_bad_tool_requests(http):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for body, param in [
        ({**base, "tools": {"type": "function", "function": {"name": "add"}}}, "tools"),
        ({**base, "tools": ADD_TOOL + [{"type": "function", "function": {}}]}, "tools[1].function.name"),
        ({**base, "tools": ADD_TOOL, "tool_choice": "required"}, "tool_choice"),
        ({**base, "tools": ADD_TOOL, "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
        ({**base, "messages": base["messages"] + [{"role": "tool", "tool_call_id": "call_0"}]}, "messages[1].content"),
    ]:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert http.post("/v1/chat/completions", json={**base, "tools": ADD_TOOL}).status_code == 200


# ---- admin routes over HTTP ----------------------------------------------------------------------------


@pytest.mark.one_end
def test_admin_requires_the_admin_token(http):
    plain = httpx.get(http.base_url.join("/admin/weights_checksum"))
    assert plain.status_code == 401 and plain.json()["error"]["type"] == "authentication_error"
    wrong = http.get("/admin/weights_checksum", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403
    # The API key is not the admin token.
    assert http.get("/admin/weights_checksum").status_code == 403
    assert http.post("/admin/drop_kv").status_code == 403


@pytest.mark.one_end
def test_admin_calls_a_pod_makes_together_are_refused_on_one_host(worker):
    """In a pod, loading weights and dropping the KV cache are calls every process makes
    together: one host's admin route paired with another host's next trainer call, or waited
    for a partner that never came and wrote that host off as lost."""
    backend = WorkerBackend(worker)
    backend.pod_processes = 2  # what jax.process_count() says in a pod of two
    version = worker.weight_version
    routes = [("drop_kv", {}), ("rebuild_kv", {}), ("reload_weights", {"path": "/nowhere", "format": "hf"})]
    routes += [("load_lora", {"lora_path": "/nowhere"}), ("perturb_weights", {"seed": 1, "scale": 0.1})]
    with Server(backend, ServerConfig(port=0, admin_token=ADMIN_TOKEN)) as server:
        for route, body in routes:
            response = httpx.post(f"{server.url}/admin/{route}", json=body, headers=ADMIN)
            assert response.status_code == 409, (route, response.text)
            assert response.json()["error"]["code"] == "pod_spmd_call"
            assert "every process makes together" in response.json()["error"]["message"]
    assert not worker.kv_dropped and worker.weight_version == version


@pytest.mark.one_end
def test_perturb_changes_the_checksum_and_reload_restores_it(http, original_checkpoint):
    reload = {"path": original_checkpoint, "format": "orbax"}
    assert http.post("/admin/reload_weights", json=reload, headers=ADMIN).status_code == 200
    original = checksum(http)
    assert original["leaves"] == 26
    before = complete(http, temperature=0).json()

    perturbed = http.post(
        "/admin/perturb_weights", json={"seed": 3, "scale": 0.05, "num_leaves": 4}, headers=ADMIN
    ).json()
    assert perturbed["checksum_before"] == original["checksum"]
    assert perturbed["checksum_after"] != original["checksum"]
    assert perturbed["weight_version"] == original["weight_version"] + 1
    assert checksum(http)["checksum"] == perturbed["checksum_after"]
    after = complete(http, temperature=0).json()
    assert after["weight_version"] == perturbed["weight_version"]

    restored = http.post("/admin/reload_weights", json=reload, headers=ADMIN)
    assert restored.status_code == 200
    assert restored.json()["version"] == perturbed["weight_version"] + 1
    assert checksum(http)["checksum"] == original["checksum"]
    again = complete(http, temperature=0)
    assert again.json()["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    assert again.headers["x-weight-version"] == str(restored.json()["version"])

    # The same perturbation of the same weights gives the same weights.
    repeat = http.post("/admin/perturb_weights", json={"seed": 3, "scale": 0.05, "num_leaves": 4}, headers=ADMIN).json()
    assert repeat["checksum_after"] == perturbed["checksum_after"]
    # Later tests of the module compare the served tokens with the original weights'.
    assert http.post("/admin/reload_weights", json=reload, headers=ADMIN).status_code == 200


@pytest.mark.one_end
def test_bad_reload_keeps_the_weights(http, tmp_path):
    before = checksum(http)
    missing = http.post(
        "/admin/reload_weights", json={"path": str(tmp_path / "nope"), "format": "orbax"}, headers=ADMIN
    )
    assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]
    (tmp_path / "junk").mkdir()
    junk = http.post("/admin/reload_weights", json={"path": str(tmp_path / "junk"), "format": "hf"}, headers=ADMIN)
    assert junk.status_code == 404 and "safetensors" in junk.json()["error"]["message"]
    bad_format = http.post("/admin/reload_weights", json={"path": str(tmp_path), "format": "pt"}, headers=ADMIN)
    assert bad_format.status_code == 400 and bad_format.json()["error"]["param"] == "format"
    assert checksum(http) == before
    assert complete(http).status_code == 200


@pytest.mark.one_end
def test_kv_drop_makes_generation_wait_until_rebuilt(http, worker):
    dropped = http.post("/admin/drop_kv", headers=ADMIN)
    try:
        assert dropped.status_code == 200 and dropped.json()["bytes"] > 0
        assert http.get("/ready").status_code == 503
        assert http.get("/admin/memory", headers=ADMIN).json()["kv_bytes"] == 0
        refused = complete(http)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "kv_cache_dropped"
    finally:  # the module's later tests need the KV back, whatever failed here
        rebuilt = http.post("/admin/rebuild_kv", headers=ADMIN)
    assert rebuilt.json()["bytes"] == dropped.json()["bytes"]
    assert http.get("/ready").status_code == 200
    assert complete(http).status_code == 200


@pytest.mark.one_end
def test_train_step_context_answers_503_until_the_next_sync(http, worker, chat_dir):
    params = jax.tree_util.tree_map(jax.device_put, load_hf_params(chat_dir))
    try:
        with worker.released_for_training():
            refused = complete(http)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "service_unavailable" and error["code"] == "released_for_training"
            assert "the KV cache is released for training" in error["message"]
        stale = complete(http)  # stale weights until the trainer syncs
        assert stale.status_code == 503 and stale.json()["error"]["code"] == "released_for_training"
    finally:  # serving again for the module's later tests, whatever failed here
        version = worker.sync_params(params).version
    response = complete(http)
    assert response.status_code == 200 and response.json()["weight_version"] == version


# ---- bad requests ------------------------------------------------------------------------------

LONG = list(range(1, 300))
BAD_REQUESTS = [
    ("malformed json", b'{"model": "tiny", "prompt": [1, 2', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("unknown model", {"model": "gpt-9", "prompt": PROMPT}, 404, "model"),
    ("missing model", {"prompt": PROMPT}, 400, "model"),
    ("missing prompt", {"model": "tiny"}, 400, "prompt"),
    ("max_tokens beyond context", {"model": "tiny", "prompt": PROMPT, "max_tokens": 100000}, 400, "max_tokens"),
    (
        "prompt + max_tokens beyond context",
        {"model": "tiny", "prompt": LONG[:200], "max_tokens": 100},
        400,
        "max_tokens",
    ),
    ("prompt longer than context", {"model": "tiny", "prompt": LONG, "max_tokens": 1}, 400, "prompt"),
    (
        "streamed, prompt longer than context",
        {"model": "tiny", "prompt": LONG, "max_tokens": 1, "stream": True},
        400,
        "prompt",
    ),
    ("temperature out of range", {"model": "tiny", "prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ("top_p zero", {"model": "tiny", "prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ("n zero", {"model": "tiny", "prompt": PROMPT, "n": 0}, 400, "n"),
    ("n a string", {"model": "tiny", "prompt": PROMPT, "n": "2"}, 400, "n"),
    ("seed beyond int64", {"model": "tiny", "prompt": PROMPT, "seed": 2**63}, 400, "seed"),
    ("token id outside vocab", {"model": "tiny", "prompt": [5, 100000]}, 400, "prompt"),
    ("negative token id", {"model": "tiny", "prompt": [-3, 5]}, 400, "prompt"),
    ("unsupported logprobs", {"model": "tiny", "prompt": PROMPT, "logprobs": 2}, 400, "logprobs"),
    ("top_k a string", {"model": "tiny", "prompt": PROMPT, "top_k": "x"}, 400, "top_k"),
    ("top_k below -1", {"model": "tiny", "prompt": PROMPT, "top_k": -2}, 400, "top_k"),
    ("min_p above 1", {"model": "tiny", "prompt": PROMPT, "min_p": 5}, 400, "min_p"),
    ("stop_token_ids not ids", {"model": "tiny", "prompt": PROMPT, "stop_token_ids": [5, "x"]}, 400, "stop_token_ids"),
    (
        "stop token id outside vocab",
        {"model": "tiny", "prompt": PROMPT, "stop_token_ids": [100000]},
        400,
        "stop_token_ids[0]",
    ),
    ("body over the limit", {"model": "tiny", "prompt": "1" * (2 << 20)}, 413, None),
    # Not valid Unicode (a lone surrogate, as its JSON escape), and nesting json.loads would recurse into.
    ("lone surrogate in stop", b'{"model": "tiny", "prompt": [5, 17], "stop": ["ok", "\\ud800"]}', 400, "stop[1]"),
    (
        "streamed, lone surrogate in stop",
        b'{"model": "tiny", "prompt": [5], "stop": "\\ud800", "stream": true}',
        400,
        "stop",
    ),
    ("100000 levels of lists", b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    (
        "100000 levels of objects",
        b'{"model": "tiny", "prompt": [5], "user": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}",
        400,
        None,
    ),
]


@pytest.mark.one_end
@pytest.mark.parametrize("body,status,param", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_completion_request(http, body, status, param):
    if isinstance(body, bytes):
        response = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param
    assert complete(http).status_code == 200


@pytest.mark.one_end
def test_bad_chat_requests(http):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for body, param in [
        ({**base, "messages": []}, "messages"),
        ({**base, "messages": [{"content": "hi"}]}, "messages[0].role"),
        ({**base, "messages": ["hi"]}, "messages[0]"),
        ({**base, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({**base, "max_tokens": 0}, "max_tokens"),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}', "stop[0]"),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ]:
        if isinstance(body, str):  # JSON text with an escape httpx would not send
            response = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        else:
            response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert http.post("/v1/chat/completions", json={**base, "max_tokens": 2}).status_code == 200


@pytest.mark.one_end
def test_api_key_is_required_on_v1_routes(server, http):
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer sk-wrong"}).status_code == 403
    assert httpx.get(server.url + "/health").status_code == 200
    assert complete(http).status_code == 200


# ---- several servers, another worker ---------------------------------------------------------


@pytest.mark.one_end
def test_several_servers_in_one_process(worker, chat_dir, qwen2_dir, http):
    """A second server on the same worker, and a third over a second worker (two engines)."""
    with (
        worker.serve() as shared,
        RolloutWorker(tiny_worker_config(qwen2_dir, dp_size=2)) as other_worker,
        other_worker.serve() as other,
    ):
        assert shared.port != other.port
        name = qwen2_dir.name
        assert httpx.get(other.url + "/admin/weights_checksum").status_code == 404  # no admin token: not mounted
        body = {"model": name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        # Same weights (both dirs are seed 0): the same greedy tokens and checksums, on every engine.
        ours = complete(http, temperature=0).json()["choices"][0]["token_ids"]
        assert (
            httpx.post(other.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"] == ours
        )
        shared_body = {**body, "model": chat_dir.name}
        assert (
            httpx.post(shared.url + "/v1/completions", json=shared_body, timeout=60).json()["choices"][0]["token_ids"]
            == ours
        )
        original = other_worker.weights_checksum()
        assert original["per_engine"] == [checksum(http)["checksum"]] * 2
        other_worker.perturb_weights(seed=1, scale=0.1, num_leaves=2)
        perturbed = other_worker.weights_checksum()["per_engine"]
        assert perturbed[0] == perturbed[1] != original["checksum"]
        no_template = httpx.post(
            other.url + "/v1/chat/completions",
            json={"model": name, "messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
        assert no_template.status_code == 400 and "chat template" in no_template.json()["error"]["message"]
    assert not shared.running and not other.running
    assert not [t for t in threading.enumerate() if t.name.startswith(f"rollout-server-{other.port}")]
    assert complete(http).status_code == 200


# ---- load: requests during reloads -------------------------------------------------------------


@pytest.mark.one_end
def test_concurrent_requests_during_reloads_are_served_or_refused_cleanly(server, http, chat_dir):
    version = http.get("/ready").json()["weight_version"]
    result = asyncio.run(
        run_load(
            server.url,
            model="tiny",
            requests=200,
            reloads=5,
            window_s=4.0,
            max_tokens=4,
            timeout_s=120,
            reload_body={"path": str(chat_dir), "format": "hf"},
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
    )
    assert result.reload_statuses == [200] * 5
    assert len(result.outcomes) == 200
    assert set(result.counts()) <= {200, 503}, result.counts()
    for outcome in result.outcomes:
        if outcome.status == 200:
            assert outcome.weight_version is not None and int(outcome.weight_version) == outcome.body_version
            assert version <= outcome.body_version <= version + 5
        else:
            assert outcome.retry_after == "1"
        assert outcome.seconds < 120
    assert result.counts().get(200, 0) > 0
    assert http.get("/ready").json()["weight_version"] == version + 5


# ---- the command line --------------------------------------------------------------------------


def test_command_line_server_stops_on_sigterm(chat_dir, worker):
    """Another process serving the same weights: the same checksum; SIGTERM stops it cleanly."""
    with serve_process(chat_dir, env={"ROLLOUT_ADMIN_TOKEN": "env-token"}) as (process, url):
        assert httpx.get(url + "/health").status_code == 200
        remote = httpx.get(url + "/admin/weights_checksum", headers={"Authorization": "Bearer env-token"}, timeout=60)
        assert remote.json()["checksum"] == worker.weights_checksum()["checksum"]
        response = httpx.post(
            url + "/v1/completions", json={"model": chat_dir.name, "prompt": "hello", "max_tokens": 2}, timeout=60
        )
        assert response.status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


@pytest.mark.one_end
def test_close_drains_running_requests(worker, chat_dir):
    threads_before = set(threading.enumerate())
    server = worker.serve(admin_token="t")
    body = {"model": chat_dir.name, "prompt": PROMPT, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(r=httpx.post(server.url + "/v1/completions", json=body, timeout=120))
    )
    # The request is held mid-decode until the close has begun.
    with held_mid_call(worker, until=lambda: server._uvicorn.should_exit) as held:
        thread.start()
        assert held.wait(300)
        assert worker.active_calls == 1, "the request still runs when the server closes"
        server.close()
        thread.join()
    assert result["r"].status_code == 200
    assert len(result["r"].json()["choices"][0]["token_ids"]) == 160
    assert not server.running
    assert set(threading.enumerate()) <= threads_before
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")


@pytest.mark.one_end
def test_an_admin_call_cut_by_the_drain_timeout_is_answered_with_what_it_did(worker, chat_dir):
    """A drain reload waiting behind a request when close()'s drain timeout passes: the request
    is cut (503 worker_closed, its rows aborted), and the reload, which then goes ahead, is
    answered 200 with its version. It had been answered 503 worker_closed, and landed anyway."""
    server = worker.serve(admin_token="t", drain_timeout_s=0.1)
    version = worker.weight_version
    cancelling = threading.Event()  # uvicorn says so just before it cancels the running requests

    class Cancelling(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Cancel "):
                cancelling.set()

    handler, uvicorn_log = Cancelling(), logging.getLogger("uvicorn.error")
    body = {"model": chat_dir.name, "prompt": PROMPT, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    reload = {"path": str(chat_dir), "format": "hf", "in_flight": False}
    results = {}
    requests = [
        threading.Thread(
            target=lambda: results.update(generate=httpx.post(server.url + "/v1/completions", json=body, timeout=120))
        ),
        threading.Thread(
            target=lambda: results.update(
                reload=httpx.post(
                    server.url + "/admin/reload_weights",
                    json=reload,
                    headers={"Authorization": "Bearer t"},
                    timeout=120,
                )
            )
        ),
    ]
    uvicorn_log.addHandler(handler)
    try:
        # The request is held mid-decode until its cancellation has begun.
        with held_mid_call(worker, until=cancelling.is_set) as held:
            requests[0].start()
            assert held.wait(300)
            requests[1].start()
            deadline = time.monotonic() + 120
            while worker._gate.exclusive_reason is None:  # the reload waits for the request
                assert time.monotonic() < deadline, "the reload never waited for the running request"
                time.sleep(0.01)
            server.close()
        for thread in requests:
            thread.join()
    finally:
        uvicorn_log.removeHandler(handler)
    assert results["generate"].status_code == 503
    assert results["generate"].json()["error"]["code"] == "worker_closed"
    assert results["reload"].status_code == 200, results["reload"].text
    assert results["reload"].json()["version"] == worker.weight_version == version + 1
    assert worker.active_calls == 0 and worker.engine.testing.kv_tokens_held() == 0
