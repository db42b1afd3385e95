"""rollout/engine/handle.py: the platform choices made when a config leaves them open, and the
engines that can run decode chunks."""

import pytest

from rollout.engine import EngineError, EngineOptions, tpu_interpret_mode, workarounds
from rollout.engine.handle import check_decode_steps, default_attention_backend, engine_attention_backend
from rollout.engine.programs import static_decode_chunks


@pytest.mark.parametrize(
    ("device", "backend"), [("tpu", "fa"), ("gpu", "native"), ("cuda", "native"), ("cpu", "native")]
)
def test_attention_backend_is_chosen_by_platform(device, backend):
    assert default_attention_backend(device) == backend


@pytest.mark.parametrize(
    ("requested", "device", "backend"),
    [
        (None, "tpu", "fa"),
        ("fa", "tpu", "fa"),
        ("native", "tpu", "native"),
        (None, "cpu", "native"),
        ("fa", "cpu", "native"),
    ],
)
def test_an_engine_is_started_with_the_backend_it_runs(requested, device, backend):
    assert engine_attention_backend(requested, device) == backend


def test_fa_on_a_cpu_is_kept_in_interpret_mode_only(monkeypatch):
    with tpu_interpret_mode():
        assert engine_attention_backend("fa", "cpu") == "fa"
    assert engine_attention_backend("fa", "cpu") == "native"
    # So decode chunks on "fa" asked for on a CPU are checked as the native engine they run on.
    monkeypatch.setenv(workarounds.DISABLE_ENV, "native-attention-memory")
    with pytest.raises(EngineError, match="needs workaround native-attention-memory"):
        check_decode_steps(EngineOptions(model_path="unused", decode_steps=8), engine_attention_backend("fa", "cpu"))


@pytest.mark.parametrize(
    ("overrides", "backend", "needs"),
    [
        ({}, "triton", "the native or the fa attention backend \\(not 'triton'\\)"),
        ({"record_routing": True}, "native", "record_routing off"),
        ({"max_loras": 2}, "native", "max_loras = 1"),
    ],
)
def test_engines_that_cannot_run_decode_chunks_are_refused_with_the_reason(overrides, backend, needs):
    options = EngineOptions(model_path="unused", decode_steps=8, **overrides)
    with pytest.raises(EngineError, match=f"decode_steps=8 needs {needs}"):
        check_decode_steps(options, backend)
    check_decode_steps(EngineOptions(model_path="unused", decode_steps=1, **overrides), backend)


def test_decode_chunks_run_on_the_paged_native_attention_and_the_tpu_kernel(monkeypatch):
    check_decode_steps(EngineOptions(model_path="unused", decode_steps=8), "native")
    monkeypatch.setenv(workarounds.DISABLE_ENV, "native-attention-memory")
    with pytest.raises(EngineError, match="decode_steps=8 needs workaround native-attention-memory"):
        check_decode_steps(EngineOptions(model_path="unused", decode_steps=8), "native")
    # The TPU kernel takes each step's metadata from the chunk, not the paged attention.
    check_decode_steps(EngineOptions(model_path="unused", decode_steps=8), "fa")


@pytest.mark.parametrize(
    ("device", "static"), [("gpu", True), ("cuda", True), ("rocm", True), ("tpu", False), ("cpu", False)]
)
def test_decode_chunks_are_static_where_xla_drives_loops_from_the_host(device, static):
    """A GPU's XLA waits on the host at every iteration of a loop of unknown trip count: its
    chunks fix their KV walk and draw at dispatch; TPU and CPU keep one program per batch size.
    A config's own choice wins everywhere."""
    assert static_decode_chunks(EngineOptions(model_path="unused"), device) is static
    for chosen in (True, False):
        assert static_decode_chunks(EngineOptions(model_path="unused", static_decode_chunks=chosen), device) is chosen
