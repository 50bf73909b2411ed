# The two commands a newcomer needs (both set everything up on a fresh machine first):
#   make demo   - run the main job (SCAFFOLD) with `nvflare simulator` on real non-IID Fashion-MNIST, summarise it
#   make test   - lint and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_JOBS ?= scaffold

.PHONY: setup demo demo-compare bench test test-fast lint format jobs check-jobs clean

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml scripts/setup_env.sh
	VENV=$(VENV) bash scripts/setup_env.sh
	touch $@

demo: setup
	VENV=$(VENV) bash scripts/demo.sh $(DEMO_JOBS)

demo-compare: setup
	VENV=$(VENV) bash scripts/demo.sh scaffold fedavg

bench: setup
	$(PY) -m benchmarks.step_overhead

test: setup lint
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow" --ignore=tests/e2e

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

jobs: setup
	$(PY) -m jobs.build --presets

check-jobs: setup
	$(PY) -m jobs.build --presets --check

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
