"""Supported versions (rollout/versions.py) and the packaging that declares them."""

import tomllib

import pytest
from packaging.requirements import Requirement

from rollout import versions
from tests.helpers import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _requirements(lines):
    return {req.name: req for req in map(Requirement, lines)}


def test_pyproject_declares_the_supported_ranges():
    declared = _requirements(PYPROJECT["project"]["dependencies"])
    for name, spec in versions.SUPPORTED.items():
        assert name in declared, f"pyproject.toml does not declare {name}"
        assert str(declared[name].specifier) == str(Requirement(f"{name}{spec}").specifier), name


def test_engine_is_not_a_declared_dependency():
    # Its metadata pins jax[tpu]~=0.8.0 and more; make install adds it with --no-deps.
    assert versions.ENGINE[0] not in _requirements(PYPROJECT["project"]["dependencies"])


def test_accelerator_extras_keep_the_jax_range():
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra, jax_extra in (("tpu", "tpu"), ("gpu", "cuda12")):
        (req,) = map(Requirement, extras[extra])
        assert req.name == "jax" and jax_extra in req.extras
        assert str(req.specifier) == str(Requirement("jax" + versions.SUPPORTED["jax"]).specifier)


def test_this_environment_is_supported():
    assert versions.unsupported_versions() == []


def test_out_of_range_versions_are_named(monkeypatch):
    fake = {"jax": "0.7.2", "flax": "0.13.0", "numpy": "2.2.6", "jaxlib": "0.7.2", "transformers": None}
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda name: fake[name] if name in fake else real(name))
    with pytest.raises(versions.UnsupportedVersionError) as info:
        versions.check_versions()
    message = str(info.value)
    assert "jax 0.7.2 is installed (supported: jax>=0.8.0,<0.13)" in message
    assert "flax 0.13.0 is installed (supported: flax>=0.12.0,<0.13)" in message
    assert "transformers is not installed" in message
    assert "numpy" not in message
    assert "make install" in message


def test_missing_engine_is_named(monkeypatch):
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda name: None if name == "sglang-jax" else real(name))
    assert versions.unsupported_versions() == [
        "sglang-jax is not installed (needed: sglang-jax==0.0.2, installed by `make install`)"
    ]


@pytest.mark.parametrize(
    ("jax", "flax", "needed"),
    [("0.9.2", "0.12.0", "0.12.1"), ("0.11.1", "0.12.6", "0.12.7"), ("0.11.2", "0.12.9", "0.12.10")],
)
def test_a_flax_too_old_for_the_jax_is_named_at_import_and_install(monkeypatch, capsys, jax, flax, needed):
    fake = {"jax": jax, "jaxlib": jax, "flax": flax}
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda name: fake.get(name) or real(name))
    line = f"flax {flax} cannot run beside jax {jax}, which needs flax>={needed}"
    assert versions.unsupported_versions() == [line]
    assert versions._main(["constraints"]) == 1
    assert line in capsys.readouterr().err
    fake["flax"] = needed
    assert versions.unsupported_versions() == []
    assert versions._main(["constraints"]) == 0


def test_the_flax_each_jax_needs():
    assert versions.flax_needed("0.8.0") is None
    assert versions.flax_needed("0.10.2") == "0.12.1"
    assert versions.flax_needed("0.12.0.1") == "0.12.10"


def test_install_requirements(monkeypatch, capsys):
    assert versions.oldest_requirements()[:3] == ["jax==0.8.0", "jaxlib==0.8.0", "flax==0.12.0"]
    assert all("<" in r and ">=" in r for r in versions.newest_requirements())
    assert versions._main(["constraints"]) == 0
    pins = capsys.readouterr().out.split()
    import jax

    assert f"jax=={jax.__version__}" in pins
    # An environment whose jax is outside the ranges is refused before pip could move it.
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda name: "0.7.2" if name == "jax" else real(name))
    assert versions._main(["constraints"]) == 1
    assert "jax 0.7.2 (supported: jax>=0.8.0,<0.13)" in capsys.readouterr().err
