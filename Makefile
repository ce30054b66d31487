# Two commands on a fresh machine:  `make demo` (the main job) and `make test` (the suite).
# Each creates .venv with the pinned requirements first if it is missing or out of date.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo ops test variants

$(VENV)/.installed: requirements.txt requirements-deepspeed.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-build-isolation -r requirements-deepspeed.txt
	touch $@

demo: $(VENV)/.installed
	$(PY) scripts/train_ddp.py

ops: $(VENV)/.installed
	$(PY) scripts/ops_report.py

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest tests

variants: $(VENV)/.installed
	$(PY) tools/build_variants.py
