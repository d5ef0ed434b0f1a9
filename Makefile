# Two commands on a fresh machine:  make demo  and  make test.
# Both create or refresh .venv from the pinned requirements first.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv demo test lint format clean

$(STAMP): requirements.txt constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -c constraints.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

# A short federation on the embedded demo corpus: 20 phones, perplexity per round.
demo: venv
	$(VENV)/bin/fedkey simulate --data demo --clients 20 --partition user --fraction 0.5 \
		--rounds 8 --local-epochs 2 --batch-size 10 --lr 1.0 --out runs/demo

test: venv
	$(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache
