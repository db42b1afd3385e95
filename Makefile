# `make demo` (the tiny GRPO run) and `make test` set everything up from scratch (a .venv
# with python3.12). `make bench` runs the benchmarks.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu

.PHONY: demo test bench

$(STAMP): pyproject.toml
	@py=""; for c in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	  if [ -x "$$(command -v $$c)" ] && $$c -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then py=$$c; break; fi; \
	done; \
	if [ -z "$$py" ]; then echo "python3.12 is required (sglang-jax needs Python >= 3.12)" >&2; exit 1; fi; \
	[ -x $(PY) ] || $$py -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,examples]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.grpo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m bench.sync_bench
	$(PY) -m bench.kv_bench
	$(PY) -m bench.checkpoint_bench
	$(PY) -m bench.logprobs_bench
