# Two commands on a fresh machine:  make demo  and  make test.
# Both create or refresh .venv from the pinned requirements first (and the keyboard's pinned
# onnxruntime-web, for its in-browser mode, when npm is there).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv demo test lint format clean

$(STAMP): requirements.txt constraints.txt pyproject.toml keyboard_web/package-lock.json
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -c constraints.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	if command -v npm >/dev/null; then npm ci --prefix keyboard_web --ignore-scripts --no-audit --no-fund --loglevel=error; \
	else echo "npm not found: the keyboard's in-browser (wasm) mode will be unavailable"; fi
	touch $(STAMP)

venv: $(STAMP)

# The whole system on the embedded demo corpus: a federation server, 20 phones training, an ONNX
# export after every round and the web keyboard following them. Ctrl-C stops everything.
demo: venv
	$(VENV)/bin/fedkey demo --out runs/demo

test: venv
	$(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache keyboard_web/node_modules
