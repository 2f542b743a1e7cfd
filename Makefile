# Two commands for learners: `make lab` and `make test`. Python >= 3.11 and make are all they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
READY  := $(VENV)/.installed
# rfc3987-syntax (with lark, its only user) comes in through jupyter-events' jsonschema[format-nongpl]
# extra, and compiles an Earley grammar on import: 2 s in every process that imports nbformat (each
# grading run, each nbgrader command). Only jsonschema's optional "iri" format checks use it, and
# nothing here validates one; without it jsonschema skips that format (measured: nbformat imports in
# 0.26 s instead of 2.3 s, `course check` of a chapter 2.5 s sooner).
SLOW_IMPORTS := rfc3987-syntax lark
PYTEST_ARGS ?=

.PHONY: lab test test-browser test-hub test-image test-python test-determinism release doctor check bench clean

$(READY): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is needed, found " + sys.version.split()[0])'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	$(BIN)/python -m pip uninstall --quiet --yes $(SLOW_IMPORTS)
	touch $(READY)

## JupyterLab on the workbook, with live Redis and PostgreSQL (stopped when you quit)
LAB_ARGS ?=
lab: $(READY)
	PATH="$(CURDIR)/$(BIN):$$PATH" exec $(BIN)/course lab $(LAB_ARGS)

## The whole test suite: course/ units, every chapter notebook, grading contracts, nbgrader flow
## (installs bubblewrap, the grading sandbox, with apt-get when root and missing)
test: $(READY)
	bash tests/setup_sandbox.sh
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -n 4 --dist loadgroup $(PYTEST_ARGS)

## JupyterLab driven by headless Chromium (installs chromium and playwright when missing); the
## chapters run in the browser are BROWSER_CHAPTERS (make test-browser BROWSER_CHAPTERS=all: every one),
## and those whose student notebook is also restarted and run in a second kernel, BROWSER_RERUNS
## (every chapter with BROWSER_CHAPTERS=all; none by default, which CI runs)
BROWSER_CHAPTERS ?= 00 13 14
BROWSER_RERUNS ?= $(if $(filter all,$(BROWSER_CHAPTERS)),all,)
test-browser: $(READY)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash tests/browser/setup.sh
	PATH="$(CURDIR)/$(BIN):$$PATH" COURSE_BROWSER_TESTS=1 BROWSER_CHAPTERS="$(BROWSER_CHAPTERS)" \
		BROWSER_RERUNS="$(BROWSER_RERUNS)" $(BIN)/python -m pytest -p no:xdist tests/browser $(PYTEST_ARGS)

## A class on a real JupyterHub (`course hub`), as root: an instructor and two learners (real accounts)
## log in with headless Chromium, release, fetch, Validate, submit, collect, autograde and return feedback
## (installs chromium, playwright and the hub extra when missing; screenshots in artifacts/hub/)
test-hub: $(READY)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,hub]'
	PATH="$(CURDIR)/$(BIN):$$PATH" bash tests/browser/setup.sh
	bash tests/setup_sandbox.sh
	PATH="$(CURDIR)/$(BIN):$$PATH" COURSE_HUB_TESTS=1 $(BIN)/python -m pytest -p no:xdist -s tests/hub $(PYTEST_ARGS)

## The single-user image's build steps (deploy/image/build.sh) on a hand-out in a temporary folder, as a script:
## no Docker engine needed (what deploy/image/Dockerfile runs, minus the base image)
test-image:
	rm -rf .course/image && mkdir -p .course/image
	git archive --format=tar HEAD -- . ':(exclude)solutions' | tar -xf - -C .course/image
	chmod 755 .course .course/image
	bash .course/image/deploy/image/build.sh .course/image

## The oldest and newest Python the README claims: the harness, the wire to a learner's process and four
## chapters' solutions graded through course check (00's basics, 05's asyncio consumers, 10's
## transactions, 13's processes and SSE), on another interpreter (make test-python PYTHON=python3.13);
## .ci/run runs it with the newest one the machine has, after make test graded every chapter
test-python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is needed, found " + sys.version.split()[0])'
	$(PYTHON) -m venv .venv-python
	.venv-python/bin/python -m pip install --quiet --upgrade pip
	.venv-python/bin/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	.venv-python/bin/python -m pip uninstall --quiet --yes $(SLOW_IMPORTS)
	PATH="$(CURDIR)/.venv-python/bin:$$PATH" .venv-python/bin/python -m pytest -n 2 -p no:cacheprovider tests/test_00_harness.py tests/test_00_wire.py tests/test_contract.py \
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
