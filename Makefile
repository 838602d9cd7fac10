# The two commands a newcomer needs: `make demo` and `make test`. Both build .venv on first use from
# the pinned constraints, so a fresh clone needs nothing but Python 3.11 and network access to PyPI.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test check run clean browser

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	scripts/install.sh $(BIN)/python dev
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m worker demo

# Lint and types first: they take seconds, and `make test` (what CI runs) then covers them too.
test: $(STAMP) check browser
	$(BIN)/python -m pytest -q -n 2

# Debian's chromium for the web page's browser tests, installed on first use.
browser:
	scripts/install-browser.sh

check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

run: $(STAMP)
	$(BIN)/python -m worker run

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# The real trainers (config/pipeline.real.toml) in a virtualenv of their own, built on first use
# (torch, Coqui TTS, Resemblyzer: about 2 GB); never the worker's interpreter.
TRAINER_VENV  := trainers/.venv
TRAINER_STAMP := $(TRAINER_VENV)/.installed

.PHONY: trainers test-trainers

trainers: $(TRAINER_STAMP)

$(TRAINER_STAMP): trainers/pyproject.toml trainers/constraints.txt scripts/install-trainers.sh
	scripts/install-trainers.sh $(PYTHON) $(TRAINER_VENV) dev
	touch $(TRAINER_STAMP)

# The three real stages by hand on an espeak-ng dataset, in the ci profile (a few CPU-minutes).
test-trainers: $(TRAINER_STAMP)
	cd trainers && .venv/bin/python -m pytest -q tests

# Benchmarks (not part of `make test`): ratios against baselines measured side by side in one run.
.PHONY: bench
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -r benchmarks/requirements.txt
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/requests_per_job.py
	$(BIN)/python benchmarks/handover.py
	$(BIN)/python benchmarks/idle_rss.py
	$(BIN)/python benchmarks/download_rss.py
	$(BIN)/python benchmarks/resume_fraction.py
	$(BIN)/python benchmarks/dataset.py
	$(BIN)/python benchmarks/uploads.py
	$(BIN)/python benchmarks/downloads.py
	$(BIN)/python benchmarks/job.py

# The real trainers (trainers/, their own virtualenv; not part of `make test`): a voice actually cloned
# on this CPU, then the trainers' own tests (the scorers' discrimination, fine-tuning from a base, the
# device rule). Both build trainers/.venv on first use.
.PHONY: test-real demo-real
test-real: $(STAMP) $(TRAINER_STAMP)
	$(BIN)/python -m pytest -q tests/real
	cd trainers && .venv/bin/python -m pytest -q tests

demo-real: $(STAMP) $(TRAINER_STAMP)
	$(BIN)/python -m worker demo --real
