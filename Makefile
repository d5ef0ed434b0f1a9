# Two commands on a fresh machine:  make demo  and  make test.
# Both create or refresh .venv first: fedkey (editable) with its runtime dependencies
# (pyproject.toml's [project] dependencies) and its dev group (tests, lint, types), every package
# at the exact version constraints.txt pins; and the keyboard's pinned onnxruntime-web, for its
# in-browser mode, when npm is there.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv demo base-model test test-fast lint imports format clean docs

# pip >= 25.1 installs a PEP 735 dependency group (--group); setuptools >= 77 (PEP 639 license metadata) is the build
# backend pyproject.toml names, used from the venv (--no-build-isolation).
$(STAMP): pyproject.toml experiments/pyproject.toml constraints.txt keyboard_web/package-lock.json
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "pip>=25.1" "setuptools>=77"
	$(PY) -m pip install -q -c constraints.txt --no-build-isolation -e . --group dev
	$(PY) -m pip install -q -c constraints.txt --no-build-isolation -e experiments
	if command -v npm >/dev/null; then npm ci --prefix keyboard_web --ignore-scripts --no-audit --no-fund --loglevel=error; \
	else echo "npm not found: the keyboard's in-browser (wasm) mode will be unavailable"; fi
	touch $(STAMP)

venv: $(STAMP)

# The whole system on NUS SMS (real text messages, fetched once into the data directory; offline,
# the Chit-Chat senders held out of pretraining): the shipped base model fine-tuned by a federation
# server and a phone per sender, an ONNX export of the round best on validation so far and the web
# keyboard serving it. Ctrl-C stops everything.
demo: venv
	$(VENV)/bin/fedkey demo --out runs/demo

# The base model that ships with fedkey (--init base), trained again with its committed recipe and
# written into the package (models/shipped/; about 31 CPU-minutes). docs/how-to/pretrain.md.
base-model: venv
	$(VENV)/bin/fedkey pretrain --shipped --out runs/base-model

# The product's tests, then the research harness's (experiments/tests, its own pytest settings).
test: venv
	$(PY) -m pytest -q
	cd experiments && ../$(PY) -m pytest -q

# The tests that take at most a few seconds each (no @pytest.mark.slow).
test-fast: venv
	$(PY) -m pytest -q -m "not slow"
	cd experiments && ../$(PY) -m pytest -q -m "not slow"

# Style, types (pyproject.toml [tool.mypy]: strict for models/ and federation/strategies/) and the
# layer contracts (pyproject.toml [tool.importlinter]).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	cd experiments && ../$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on a broken link or anchor,
# a page left out of the nav, or a reference page (generated from the code by
# tools/docs_reference.py) that no longer builds.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Which of fedkey's packages each package imports (tools/import_graph.py).
imports: venv
	$(PY) tools/import_graph.py

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) runs site .pytest_cache .mypy_cache .ruff_cache keyboard_web/node_modules
