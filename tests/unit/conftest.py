"""The unit layer boots no engine: a test here that starts one fails, so the layer stays fast."""

import pytest


@pytest.fixture(autouse=True)
def _no_engine(monkeypatch):
    from sgl_jax.srt.entrypoints.engine import Engine

    def refuse(*args, **kwargs):
        raise RuntimeError("a unit test started an sglang-jax engine: engine tests belong in tests/, not tests/unit/")

    monkeypatch.setattr(Engine, "__init__", refuse)
