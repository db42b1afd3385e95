# `make demo` (the tiny GRPO run) and `make test` set everything up from scratch.
#   .venv         python3.12 with the oldest supported jax/flax/transformers/numpy (the lower
#                 bounds in rollout/versions.py): demo, bench, and the first test run.
#   .venv-newest  the newest releases inside the supported ranges: the second test run.
# `make install PYTHON=/path/to/env/bin/python [EXTRAS=gpu,examples]` installs the worker into an
# existing environment (the trainer's) and leaves its jax, jaxlib, flax, transformers and numpy
# exactly as they are.
VENV := .venv
NEWEST := .venv-newest
VERSIONS := rollout/versions.py
PYTHON ?=
EXTRAS ?=
EDITABLE ?=
export JAX_PLATFORMS ?= cpu

.PHONY: demo test test-fast test-oldest test-newest lint bench install cpu

# The CPU the figures and tests ran on (numerics and speed differ between instruction sets).
cpu:
	@echo "== CPU: $$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//') ($$(nproc) cores)"
	@echo "== CPU vector flags: $$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | grep -E '^(sse4_2|avx|avx2|fma|f16c|avx512.*|amx.*|avx_vnni)$$' | tr '\n' ' ')"

# Creates the venv $(1) with python3.12 (found on PATH or under pyenv).
define make_venv
	@py=""; for c in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	  if [ -x "$$(command -v $$c)" ] && $$c -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then py=$$c; break; fi; \
	done; \
	if [ -z "$$py" ]; then echo "python3.12 is required (sglang-jax needs Python >= 3.12)" >&2; exit 1; fi; \
	[ -x $(1)/bin/python ] || $$py -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
endef

# sglang-jax without its declared dependencies (their pins would move jax), then this project,
# whose dependencies are the ones the engine really needs; the constraints pin the supported
# libraries the environment already has, so pip cannot change them. --no-warn-conflicts: pip
# would list every pin of sglang-jax's metadata that the environment (deliberately) ignores.
install:
	@[ -n "$(PYTHON)" ] || { echo "usage: make install PYTHON=/path/to/env/bin/python [EXTRAS=gpu,examples]" >&2; exit 2; }
	@set -e; constraints=$$(mktemp); trap 'rm -f $$constraints' EXIT; \
	$(PYTHON) $(VERSIONS) constraints > $$constraints; \
	echo "keeping: $$(tr '\n' ' ' < $$constraints)"; \
	$(PYTHON) -m pip install -q -c $$constraints --no-deps "$$($(PYTHON) $(VERSIONS) engine)"; \
	$(PYTHON) -m pip install -q --no-warn-conflicts -c $$constraints $(EDITABLE) "$(if $(EXTRAS),.[$(EXTRAS)],.)"

$(VENV)/.installed: pyproject.toml $(VERSIONS)
	$(call make_venv,$(VENV))
	$(VENV)/bin/python -m pip install -q $$($(VENV)/bin/python $(VERSIONS) oldest)
	$(MAKE) --no-print-directory install PYTHON=$(VENV)/bin/python EXTRAS=test,examples EDITABLE=-e
	touch $@

$(NEWEST)/.installed: pyproject.toml $(VERSIONS)
	$(call make_venv,$(NEWEST))
	$(NEWEST)/bin/python -m pip install -q --upgrade $$($(NEWEST)/bin/python $(VERSIONS) newest)
	$(MAKE) --no-print-directory install PYTHON=$(NEWEST)/bin/python EXTRAS=test EDITABLE=-e
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/python -m examples.grpo

# Both ends of the supported range, side by side (-k: one end's failure does not stop the other;
# --output-sync: each end's log printed whole when it ends). Each end builds its own venv and
# starts as soon as it is ready (the oldest lints first). A run is mostly one Python thread (the
# engine's scheduler, the test) with XLA's compiles between: on 2 cores the two ends overlap.
# Groups that exercise the same code at both ends run at one of them, which evens out their times:
# - the oldest end only: `pinning` (each engine workaround disabled in a process of its own,
#   10-25 s each: the engine's bugs, the same 0.0.2 code at both ends; the flax workaround, which
#   differs, has its own test that runs at both) and `example_run` (the RL examples' learning
#   curves, minutes each: their thresholds were set at the oldest);
# - the newest end only: `example_path` (an example's code path end to end, no threshold),
#   `example_run_newest` (learning curves whose thresholds were set there: the MoE preset in bf16,
#   LoRA) and `one_end` (the HTTP server, typed errors, admission limits, aborts, batching across threads,
#   the sync gate and the docs' code blocks: Python that no version in the range changes; what
#   they call in the worker is tested at both ends).
test: cpu
	@$(MAKE) --no-print-directory -k -j2 --output-sync=target test-oldest test-newest

# The unit layer: tests/unit boots no engine (its conftest refuses one), for the edit-test loop.
test-fast: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q tests/unit

# The formatter and linter settings are pyproject.toml's [tool.ruff].
lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test-oldest: $(VENV)/.installed lint
	@$(VENV)/bin/python -c 'import jax, flax; print(f"== oldest: jax {jax.__version__}, flax {flax.__version__}")'
	$(VENV)/bin/python -m pytest -q --durations=0 --durations-min=5 -m "not example_path and not one_end and not example_run_newest and not newest_end"

test-newest: $(NEWEST)/.installed
	@$(NEWEST)/bin/python -c 'import jax, flax; print(f"== newest: jax {jax.__version__}, flax {flax.__version__}")'
	$(NEWEST)/bin/python -m pytest -q --durations=0 --durations-min=5 -m "not pinning and not example_run and not oldest_end"

bench: $(VENV)/.installed
	$(VENV)/bin/python -m bench.sync_bench
	$(VENV)/bin/python -m bench.kv_bench
	$(VENV)/bin/python -m bench.checkpoint_bench
	$(VENV)/bin/python -m bench.logprobs_bench
	$(VENV)/bin/python -m bench.sync_overhead_bench
	$(VENV)/bin/python -m bench.generate_bench
	$(VENV)/bin/python -m bench.step_cost_bench
	$(VENV)/bin/python -m bench.episodes_bench
	XLA_FLAGS=--xla_force_host_platform_device_count=4 $(VENV)/bin/python -m bench.dp_bench
	XLA_FLAGS=--xla_force_host_platform_device_count=4 $(VENV)/bin/python -m bench.moe_sync_bench
	XLA_FLAGS=--xla_force_host_platform_device_count=4 $(VENV)/bin/python -m bench.moe_parity_bench
