# make run: set up .venv (first time only) and run the main job; make test: set up, lint and run the tests;
# make test-fast: the same less the tests marked slow.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup run test test-fast clean-venv gpu-bundle check-gpu-bundle
setup: $(VENV)/.installed

# Re-installs only when requirements.txt changes.
$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

run: setup
	$(PY) run.py

# ruff first (pyproject.toml: line length, import order, pyflakes, bugbear), then the tests
test: setup
	$(PY) -m ruff check .
	WANDB_MODE=disabled $(PY) -m pytest -q -n auto --maxprocesses 4 --durations 15 tests

# the same, less the tests marked slow (end-to-end runs: run.py sweeps, whole trainings, compiles,
# builds from scratch; docs/testing.md): the lane to run while working, make test before a commit
test-fast: setup
	$(PY) -m ruff check .
	WANDB_MODE=disabled $(PY) -m pytest -q -n auto --maxprocesses 4 --durations 15 -m "not slow" tests

# Wheels (Python 3.12, manylinux x86_64) + the fast-transformers sdist for an offline GPU machine,
# in gpu_bundle/ (git-ignored, <= 40 MB); see docs/gpu.md. Needs PyPI.
gpu-bundle: setup
	PY=$(PY) bash scripts/gpu_bundle.sh

# Installs gpu_bundle/ with --no-index into a clean Python 3.12 venv and imports what it holds.
check-gpu-bundle:
	bash scripts/check_gpu_bundle.sh

clean-venv:
	rm -rf $(VENV)
