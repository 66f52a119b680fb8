# osvl: `make demo` and `make test` set everything up on a fresh machine, then run.
#
# The venv is (re)installed only when the dependency files change: the stamp file
# name carries a hash of pyproject.toml and constraints.txt.
#
# torch is installed first and pinned, because deepspeed/basicsr let pip pick a
# multi-GB CUDA build otherwise. GPU users choose their build with TORCH_SPEC, e.g.
#   make demo TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
DEPS_HASH := $(shell cat pyproject.toml constraints.txt 2>/dev/null | sha256sum | cut -c1-12)
STAMP := $(VENV)/.osvl-deps-$(DEPS_HASH)
PYTEST_ARGS ?=
# Ray must stay on loopback in everything make starts (see osvl/cluster.py).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup demo test test-fast lint mutation ray-up ray-down clean-venv

setup: $(STAMP)

# basicsr's metadata pulls torchvision and opencv-python, which break this stack: it is
# installed without dependencies and osvl imports only its architecture module.
# DeepSpeed JIT-compiles its CPU shared-memory comm op (~60 s) on first use: done here,
# not inside a timed test.

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@rm -f $(VENV)/.osvl-deps-*
	@echo "== installing dependencies (deps hash $(DEPS_HASH))"
	$(PIP) install --quiet $(TORCH_SPEC) -c constraints.txt -e '.[dev]'
	$(PIP) install --quiet --no-deps -c constraints.txt basicsr==1.4.2
	$(PY) -c "from deepspeed.accelerator import get_accelerator as g; g().create_op_builder('ShareMemCommBuilder').load()" 2>&1 | tail -1
	@touch $@

demo: setup
	$(PY) jobs/demo.py

test: setup lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup lint
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

mutation: setup
	$(VENV)/bin/mutmut run --max-children 2 && $(VENV)/bin/mutmut results

# A loopback-only head node for `ray job submit` (see README).
ray-up: setup
	$(PY) -m osvl.cluster up

ray-down:
	$(PY) -m osvl.cluster down

clean-venv:
	rm -rf $(VENV)

# Pin what the suite ran with (torch excluded: TORCH_SPEC chooses it).
constraints: setup
	( sed -n '1,3p' constraints.txt; $(PIP) freeze --exclude-editable | grep -viE '^(torch|osvl|nvidia|triton)[= ]' ) > constraints.new && mv constraints.new constraints.txt
