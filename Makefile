# `make demo` and `make test` each create the project virtualenv and install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MEMLM := $(VENV)/bin/memlm
# faiss-gpu where nvidia-smi finds a GPU, faiss-cpu otherwise (never both in one environment).
FAISS_EXTRA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP := $(VENV)/.installed-$(FAISS_EXTRA)

.PHONY: venv demo test proto proto-check fetch bench clean docs

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Pinned first: on CPU machines this resolves to the CPU wheel; unpinned torch pulls GBs of CUDA.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[$(FAISS_EXTRA),dev]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

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
	$(PY) -m pytest -q tests
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
	rm -rf $(VENV) build *.egg-info
