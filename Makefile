# make run: set up .venv (first time only) and run the main job; make test: set up and run the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup run test clean-venv
setup: $(VENV)/.installed

# Re-installs only when requirements.txt changes.
$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

run: setup
	$(PY) run.py

test: setup
	WANDB_MODE=disabled $(PY) -m pytest -q tests

clean-venv:
	rm -rf $(VENV)
