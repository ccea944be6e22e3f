# Two commands matter: `make demo` and `make test`. Both build .venv from nothing when needed:
# the demo installs the base package only (numpy, jinja2), the tests its test extra (torch,
# Triton, pytest: about 2 GB) on top.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.installed-base
STAMP := $(VENV)/.installed

.PHONY: demo test bench examples clean

$(BASE): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(BASE)

$(STAMP): $(BASE)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(BASE)
	$(VENV)/bin/eins demo

test: $(STAMP)
	$(PY) -m pytest -n 2 tests

# every example, with the environment's Python (no need to activate .venv); the torchrun
# one as 2 ranks of one node on this machine
examples: $(STAMP)
	for e in examples/*.py; do \
	  echo "== $$e"; \
	  case $$e in \
	    *torchrun_*) $(VENV)/bin/torchrun --nproc-per-node=2 --master-addr=127.0.0.1 \
	                 --master-port=29533 $$e --check || exit 1;; \
	    *) $(PY) $$e || exit 1;; \
	  esac; \
	done

# the CPU benchmarks (benchmarks/bench_*.py); the GPU ones (gpu_*.py, device_session.sh)
# need the device machine: docs/gpu.md
bench: $(STAMP)
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
