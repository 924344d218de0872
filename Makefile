# The two set-up commands of the README: `make demo` and `make test`, from a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch 2.13.0; any other spec pulls several GB of CUDA packages.
TORCH := torch==2.13.0

.PHONY: install demo test test-torch lint bench clean clusters slurm ray torchx frameworks

$(BIN)/ringtrain: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

install: $(BIN)/ringtrain

demo: install
	$(BIN)/ringtrain train --nproc-per-node 2

# Two pytest workers (pytest-xdist), a test file each at a time: most tests wait on worker
# processes starting and on timeouts, so two files at once fit the two cores; PYTEST_ARGS= runs
# one file after another.
PYTEST_ARGS ?= -n 2 --dist loadfile
test: install
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

# The tiers: `make test` is all of it; `make test-fast` runs the tests that start no process
# (~1410 of them, ~17 s of CPU, 35 s wall measured), for the edit-test loop. A
# test is in the fast tier by what it does, not by a label: under --fast (tests/conftest.py)
# a test that starts a process (subprocess, multiprocessing, run_workers' forkserver) is
# skipped where it starts it, and the last line counts both; a test over 2 s is named (mark it
# `slow`, which stays out). One pytest process: two xdist workers saved 11 s idle but cost more
# on a busy machine (117 s against 54 s wall) and reorder tests across processes.
# Markers pick among the rest: `pytest -m "not slow"`, `-m multinode` (root), `-m cuda` (a GPU).
.PHONY: test-fast
test-fast: install
	$(BIN)/python -m pytest -q --fast -m "not slow"

# `make test-torch TORCH_VERSION=2.11.0`: the same suite on another torch, in its own
# .venv-torch-$(TORCH_VERSION), kept and reused (pip only checks an installed torch). This is
# how the range in pyproject.toml was earned: a minor goes in only once this passes on it.
# 2.13.0 is the local CPU wheel; other versions are PyPI's CUDA builds, several GB with their
# nvidia-* packages, which run on CPU. PIP_CONSTRAINT=/dev/null: pip here caps torch through
# /etc/xdg/pip/constraints.txt (torch<=2.14.1); the versions under test must get past it.
TORCH_VERSION ?= 2.13.0
TORCH_VENV := .venv-torch-$(TORCH_VERSION)
test-torch:
	@test -x $(TORCH_VENV)/bin/python || $(PY) -m venv $(TORCH_VENV)
	PIP_CONSTRAINT=/dev/null $(TORCH_VENV)/bin/pip install -q torch==$(TORCH_VERSION) -e '.[dev]'
	$(TORCH_VENV)/bin/python -m pytest -q -ra $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check ringtrain tests benchmarks

# Optional: what tests/test_slurm.py, test_ray.py and test_torchx.py need (they skip, saying
# so, without it). Slurm: Debian's packages, root only (10 s, 46 MB); Ray: 15 s, 520 MB.
clusters: slurm ray torchx

slurm:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; \
	else echo "make slurm: needs root and apt-get: apt-get install -y slurm-wlm munge"; fi

ray: install
	$(BIN)/pip install -q -e '.[dev,ray]'

torchx: install
	$(BIN)/pip install -q -e '.[dev,torchx]'

# Optional: Lightning and accelerate for tests/test_frameworks.py (they skip, saying so, without
# them); about 40 MB installed. $(TORCH) keeps pip from replacing the CPU build of torch.
frameworks: install
	$(BIN)/pip install -q $(TORCH) -e '.[dev,frameworks]'

bench: install
	$(BIN)/python benchmarks/ddp_vs_torch.py

clean:
	rm -rf $(VENV) runs .pytest_cache
