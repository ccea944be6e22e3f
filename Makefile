# Two commands matter: `make demo` and `make test`. Both build .venv from nothing when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench examples clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/eins demo

test: $(STAMP)
	$(PY) -m pytest -n 2 tests

# every example, with the environment's Python (no need to activate .venv)
examples: $(STAMP)
	for e in examples/*.py; do echo "== $$e"; $(PY) $$e || exit 1; done

bench: $(STAMP)
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
