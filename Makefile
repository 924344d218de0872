# The two set-up commands of the README: `make demo` and `make test`, from a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch 2.13.0; any other spec pulls several GB of CUDA packages.
TORCH := torch==2.13.0

.PHONY: install demo test lint bench clean

$(BIN)/ringtrain: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

install: $(BIN)/ringtrain

demo: install
	$(BIN)/ringtrain train --nproc-per-node 2

test: install
	$(BIN)/python -m pytest -q -ra

lint: install
	$(BIN)/ruff check ringtrain tests benchmarks

bench: install
	$(BIN)/python benchmarks/ddp_vs_torch.py

clean:
	rm -rf $(VENV) runs .pytest_cache
