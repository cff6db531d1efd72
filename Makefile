# Set-up and the two jobs of this project. Everything installs from requirements.txt
# (pinned, torch==2.13.0 CPU build) into .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch builds the CPU attention operator with the ninja installed in the venv.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup demo test lint bench bench-plot

$(BIN)/python:
	$(PY) -m venv $(VENV)

setup: $(BIN)/python .triton/.installed
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -r requirements-nodeps.txt
	$(BIN)/pip install -q --no-deps -e .

# Only tests/attention/test_triton_attn.py puts this on its child's PYTHONPATH.
.triton/.installed: requirements-triton.txt $(BIN)/python
	rm -rf .triton
	$(BIN)/pip install -q --no-deps --target .triton -r requirements-triton.txt
	touch $@

# The bundled stories260K, greedy from BOS: its published story is 61 tokens.
demo: setup
	$(BIN)/decodegraph --log-level WARNING generate --max-tokens 61

test: setup
	$(BIN)/ruff check decodegraph tests benchmarks
	$(BIN)/python -m pytest -q -rs tests

lint: setup
	$(BIN)/ruff check decodegraph tests benchmarks
	$(BIN)/ruff format --check decodegraph tests benchmarks

# Batch-1 and 256 x 200 decode speed of the eager mode (NONE) and the default graph mode,
# beside transformers, at one intra-op thread, on stories260K: a minute or two on a
# 2-core machine. Saves benchmarks/results/bench_decode.json. `make bench BENCH_ARGS=`
# runs every graph mode; `$(BIN)/python benchmarks/bench_decode.py --help` lists the flags.
BENCH_ARGS ?= --modes NONE FULL_DECODE_ONLY --threads 1

bench: setup
	$(BIN)/python benchmarks/bench_decode.py $(BENCH_ARGS)

# The README's figure: `decodegraph bench latency` on the bundled model, every graph mode,
# batch sizes 1-16 (the CPU capture sizes go to 8: 16 shows the eager fall-back).
bench-plot: setup
	$(BIN)/decodegraph --log-level WARNING bench latency --batch-size 1 2 4 8 16 \
		--num-iters-warmup 3 --num-iters 10 \
		--output-json docs/images/bench_latency.json --plot docs/images/bench_latency.png
