# Two commands for learners: `make lab` and `make test`. Python >= 3.11 and make are all they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
READY  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: lab test test-browser test-python test-determinism release doctor check bench clean

$(READY): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is needed, found " + sys.version.split()[0])'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(READY)

## JupyterLab on the workbook, with live Redis and PostgreSQL (stopped when you quit)
LAB_ARGS ?=
lab: $(READY)
	PATH="$(CURDIR)/$(BIN):$$PATH" exec $(BIN)/course lab $(LAB_ARGS)

## The whole test suite: course/ units, every chapter notebook, grading contracts, nbgrader flow
## (installs bubblewrap, the grading sandbox, with apt-get when root and missing)
test: $(READY)
	bash tests/setup_sandbox.sh
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -n 3 --dist loadgroup $(PYTEST_ARGS)

## JupyterLab driven by headless Chromium (installs chromium and playwright when missing)
test-browser: $(READY)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash tests/browser/setup.sh
	PATH="$(CURDIR)/$(BIN):$$PATH" COURSE_BROWSER_TESTS=1 $(BIN)/python -m pytest -p no:xdist tests/browser $(PYTEST_ARGS)

## The oldest and newest Python the README claims: the harness, the integrity checks and four
## chapters' solutions graded through course check (00's basics, 05's asyncio consumers, 10's
## transactions, 13's processes and SSE), on another interpreter (make test-python PYTHON=python3.13);
## .ci/run runs it with the newest one the machine has, after make test graded every chapter
test-python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is needed, found " + sys.version.split()[0])'
	$(PYTHON) -m venv .venv-python
	.venv-python/bin/python -m pip install --quiet --upgrade pip
	.venv-python/bin/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	PATH="$(CURDIR)/.venv-python/bin:$$PATH" .venv-python/bin/python -m pytest -n 2 -p no:cacheprovider tests/test_00_harness.py tests/test_00_integrity.py tests/test_contract.py \
		-k "not test_the_student_notebook and (00_ or 05_ or 10_ or 13_)" $(PYTEST_ARGS)

## The same answer gets the same grade: every kept wrong solution graded RUNS times (default 3)
RUNS ?= 3
test-determinism: $(READY)
	PATH="$(CURDIR)/$(BIN):$$PATH" COURSE_DETERMINISM_RUNS=$(RUNS) $(BIN)/python -m pytest -n 3 -m determinism tests/test_00_determinism.py $(PYTEST_ARGS)

## Regenerate the student notebooks in notebooks/ from solutions/ with nbgrader
release: $(READY)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m autograder.release

doctor: $(READY)
	$(BIN)/course doctor

## Measured, not asserted: server cold starts, notebook run times, course check times
bench: $(READY)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) .venv-python gradebook.db submitted autograded feedback .pytest_cache
