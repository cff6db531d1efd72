# Set-up and the two jobs of this project. Everything installs from requirements.txt
# (pinned, torch==2.13.0 CPU build) into .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch builds the CPU attention operator with the ninja installed in the venv.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup demo test test-arm lint bench bench-plot

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

# Two worker processes: most tests hold one core (Python, Inductor's compiles), so on
# CI's two cores the suite takes about three quarters of its one-process time
# (docs/performance.md). worksteal rebalances around the few long tests.
test: setup
	$(BIN)/ruff check decodegraph tests benchmarks
	$(BIN)/python -m pytest -q -rs -n 2 --dist worksteal tests

# The CPU operators' NEON build and tests on aarch64 under qemu-user (root, Debian, the
# package registries): not part of `make test`.
test-arm: setup
	tools/arm_emulated.sh

lint: setup
	$(BIN)/ruff check decodegraph tests benchmarks
	$(BIN)/ruff format --check decodegraph tests benchmarks

# Batch-1 and 256 x 200 decode speed of the eager mode (NONE) and the default graph mode,
# beside CTranslate2, llama2.c (built from ../shared/peers/llama2c) and transformers, at
# one intra-op thread on every side, on stories260K: a few minutes on a 2-core machine.
# Peers that cannot be installed or built are skipped with the reason. Saves
# benchmarks/results/bench_decode.json. BENCH_ARGS="... --mid-size" adds the
# Qwen2.5-0.5B-shaped rows (fp32 and bf16, batch 1 and 32); `$(BIN)/python
# benchmarks/bench_decode.py --help` lists the flags.
BENCH_ARGS ?= --modes NONE FULL_DECODE_ONLY --threads 1

bench: setup
	-$(BIN)/pip install -q -r benchmarks/requirements.txt
	$(BIN)/python benchmarks/bench_decode.py $(BENCH_ARGS)

# The README's figure: `decodegraph bench latency` on the bundled model, every graph mode,
# batch sizes 1-16 (the CPU capture sizes go to 8: 16 shows the eager fall-back).
bench-plot: setup
	$(BIN)/decodegraph --log-level WARNING bench latency --batch-size 1 2 4 8 16 \
		--num-iters-warmup 3 --num-iters 10 \
		--output-json docs/images/bench_latency.json --plot docs/images/bench_latency.png
