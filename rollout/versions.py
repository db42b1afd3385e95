"""The versions of the trainer-side libraries this worker supports, and the check at import.

The worker runs in the trainer's process, so it uses the trainer's JAX. ``SUPPORTED`` is the one
record of the ranges: ``pyproject.toml`` declares the same specifiers (a test keeps them equal),
``make test`` runs the suite at both ends (the lower bounds, and the newest releases inside the
ranges), and ``import rollout`` refuses versions outside them.

sglang-jax 0.0.2 declares ``jax[tpu]~=0.8.0``, ``flax~=0.12.0``, ``transformers~=4.55.0`` and
``numpy~=2.2.6``; it is installed without its declared dependencies (``make install``) and works
across these ranges with the workarounds in ``rollout/engine/`` (registered in ``workarounds.py``).

Also a script, run by path before the package is importable (stdlib only)::

    python rollout/versions.py oldest       # requirements pinning every lower bound
    python rollout/versions.py newest       # the ranges, for pip install --upgrade
    python rollout/versions.py engine       # the engine requirement (installed with --no-deps)
    python rollout/versions.py constraints  # pins of what the environment already has
"""

from __future__ import annotations

import importlib.metadata
import sys

# Distribution -> PEP 440 specifier. Lower bounds are the oldest versions CI tests; upper bounds
# exclude the first release line not yet tested. transformers 5 moved rope_theta into
# rope_parameters: 0.0.2 then silently falls back to its default RoPE base (wrong tokens).
SUPPORTED: dict[str, str] = {
    "jax": ">=0.8.0,<0.13",
    "jaxlib": ">=0.8.0,<0.13",
    "flax": ">=0.12.0,<0.13",
    "transformers": ">=4.55.0,<5",
    "numpy": ">=2.2.0,<2.6",
}

# The oldest flax that can import flax.nnx (the engine's models are nnx modules) beside each jax,
# where it is above flax's lower bound: these jax releases removed names older flax releases use
# (0.9.0 jax.array_ref's fallback mutable_array, 0.11.0 jax.core.Effect, 0.11.2
# hijax.HiPrimitive). flax declares no upper bound on jax, so pip installs such pairs; they fail
# at the engine's first import. Seen with jax 0.9.2, 0.10.2 and 0.11.2 (2026-12-01); the
# releases the table starts at are those that removed the names.
FLAX_FOR_JAX: dict[str, str] = {"0.9.0": "0.12.1", "0.11.0": "0.12.7", "0.11.2": "0.12.10"}

# The engine release whose internals rollout/engine knows (its start-up checks it too).
ENGINE = ("sglang-jax", "0.0.2")


# A RuntimeError too: the engine's own check at start-up raised one before.
class UnsupportedVersionError(ImportError, RuntimeError):
    """A library in the environment is outside the versions this worker supports (at
    ``import rollout``), or the engine's start-up found another sglang-jax than ``ENGINE``."""


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _packaging():
    try:
        from packaging import specifiers, version
    except ImportError:  # run as a script in an environment without packaging (pip vendors it)
        from pip._vendor.packaging import specifiers, version
    return specifiers.SpecifierSet, version.Version


def in_range(distribution: str, version: str) -> bool:
    specifier_set, _ = _packaging()
    return specifier_set(SUPPORTED[distribution]).contains(version, prereleases=True)


def flax_needed(jax_version: str) -> str | None:
    """The oldest flax that runs beside ``jax_version`` where it is above flax's lower bound
    (``FLAX_FOR_JAX``), else None."""
    _, version = _packaging()
    needed = [flax for jax_from, flax in FLAX_FOR_JAX.items() if version(jax_version) >= version(jax_from)]
    return max(needed, key=version) if needed else None


def mismatched_pairs() -> list[str]:
    """One line if the installed flax is too old for the installed jax (both in their ranges)."""
    jax_version, flax_version = installed_version("jax"), installed_version("flax")
    if jax_version is None or flax_version is None:
        return []
    if not (in_range("jax", jax_version) and in_range("flax", flax_version)):
        return []
    needed = flax_needed(jax_version)
    _, version = _packaging()
    if needed is None or version(flax_version) >= version(needed):
        return []
    return [f"flax {flax_version} cannot run beside jax {jax_version}, which needs flax>={needed}"]


def unsupported_versions() -> list[str]:
    """One line per supported library that is missing or outside its range."""
    problems = []
    for distribution, spec in SUPPORTED.items():
        version = installed_version(distribution)
        if version is None:
            problems.append(f"{distribution} is not installed (supported: {distribution}{spec})")
        elif not in_range(distribution, version):
            problems.append(f"{distribution} {version} is installed (supported: {distribution}{spec})")
    problems += mismatched_pairs()
    name, version = ENGINE
    found = installed_version(name)
    if found != version:
        what = "is not installed" if found is None else f"{found} is installed"
        problems.append(f"{name} {what} (needed: {name}=={version}, installed by `make install`)")
    return problems


def check_versions() -> None:
    """Raise :class:`UnsupportedVersionError` naming every library outside its supported range."""
    problems = unsupported_versions()
    if problems:
        raise UnsupportedVersionError(
            "sglang-jax-rollout cannot run with this environment:\n  "
            + "\n  ".join(problems)
            + "\nSupported ranges are listed in rollout/versions.py; install with "
            "`make install PYTHON=/path/to/env/bin/python` (see the README)."
        )


def _lower_bound(spec: str) -> str:
    for clause in spec.split(","):
        if clause.startswith(">="):
            return clause[2:]
    raise ValueError(f"specifier {spec!r} has no >= lower bound")


def oldest_requirements() -> list[str]:
    return [f"{name}=={_lower_bound(spec)}" for name, spec in SUPPORTED.items()]


def newest_requirements() -> list[str]:
    return [f"{name}{spec}" for name, spec in SUPPORTED.items()]


def installed_constraints() -> list[str]:
    """Pins of the supported libraries already installed, so an install leaves them as they are."""
    pins = []
    for name in SUPPORTED:
        version = installed_version(name)
        if version is not None:
            pins.append(f"{name}=={version}")
    return pins


def _main(argv: list[str]) -> int:
    commands = {
        "oldest": oldest_requirements,
        "newest": newest_requirements,
        "engine": lambda: [f"{ENGINE[0]}=={ENGINE[1]}"],
        "constraints": installed_constraints,
    }
    if len(argv) != 1 or argv[0] not in commands:
        print(f"usage: python rollout/versions.py {{{'|'.join(commands)}}}", file=sys.stderr)
        return 2
    if argv[0] == "constraints":
        # An install must not move the environment's jax: refuse one outside the ranges.
        outside = [
            f"{name} {version} (supported: {name}{spec})"
            for name, spec in SUPPORTED.items()
            if (version := installed_version(name)) is not None and not in_range(name, version)
        ] + mismatched_pairs()
        if outside:
            print(
                "this environment has versions sglang-jax-rollout does not support:\n  " + "\n  ".join(outside),
                file=sys.stderr,
            )
            return 1
    print("\n".join(commands[argv[0]]()))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
