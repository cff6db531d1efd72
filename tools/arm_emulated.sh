#!/usr/bin/env bash
# The native operators' NEON build, and any command, on aarch64 under qemu-user, from an
# x86-64 Debian machine with no ARM hardware. Needs root (apt, binfmt_misc) and the
# package registries (Debian's and PyPI). What it sets up, once, under $DG_ARM_DIR:
#   - Debian's Python 3.11 for arm64 (its packages unpacked, not installed) and the
#     cross compiler aarch64-linux-gnu-g++, which torch's extension builder and Inductor
#     run through a wrapper (cxx) that turns -march=native into $DG_ARM_MARCH and the
#     host's Python headers into the arm64 ones;
#   - torch 2.10.0 for aarch64 (the newest release whose PyPI wheel for aarch64 is a CPU
#     build: 2.11 and later there are CUDA builds), the package's dependencies (those of
#     the server, structured outputs, Ray and the Triton interpreter too) and pytest, on
#     the emulated Python's path through a .pth file (tests start child processes with a
#     PYTHONPATH of their own);
#   - qemu-aarch64 registered with binfmt_misc, so that the emulated Python's child
#     processes (tests start some) run too.
# Without arguments it runs the operators' tests (tests/native and the layers and
# attention tests that call them); with --all the whole suite, in two pytest-xdist
# workers (not timed whole: its server, executor and distributed tests alone take 35
# minutes on two cores); otherwise the given command, e.g.
#   tools/arm_emulated.sh python -m pytest -q tests/native/test_cpu_ops.py
#   tools/arm_emulated.sh python -m decodegraph generate --max-tokens 61
# ("python" is the emulated one). Emulation is slow. It checks that the code builds and
# gives the right values on NEON, not how fast it is.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
DIR=${DG_ARM_DIR:-/tmp/decodegraph-arm}
ROOT=$DIR/root
SITE=$DIR/site
HOST_PIP=${HOST_PIP:-$REPO/.venv/bin/pip}
TORCH=2.10.0
PLATFORMS=(--platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64
           --platform manylinux2014_aarch64 --platform linux_aarch64)
PY_DEBS=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11
         libpython3.11-dev python3.11-dev libc6 libgcc-s1 libstdc++6 libgomp1 libexpat1
         zlib1g libffi8 libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libuuid1 libncursesw6
         libtinfo6 libreadline8 libdb5.3 libgdbm6 libnsl2 libtirpc3 libcrypt1 libzstd1)

pinned() { cat "$REPO/requirements.txt" "$REPO/requirements-nodeps.txt" | sed -n "s/^$1==//p"; }

setup() {
    mkdir -p "$DIR/debs" "$DIR/bin"
    if ! command -v qemu-aarch64-static >/dev/null || ! command -v aarch64-linux-gnu-g++ >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user-static g++-aarch64-linux-gnu
    fi
    if [ ! -x "$ROOT/usr/bin/python3.11" ]; then
        if ! dpkg --print-foreign-architectures | grep -qx arm64; then
            dpkg --add-architecture arm64
            apt-get update -q
        fi
        (cd "$DIR/debs" && apt-get download "${PY_DEBS[@]/%/:arm64}")
        for deb in "$DIR"/debs/*.deb; do dpkg -x "$deb" "$ROOT"; done
    fi
    if [ ! -d "$SITE/torch" ]; then
        # No dependency resolution across platforms: torch's environment markers are read
        # for this x86-64 host, so its pure-Python dependencies are named here.
        "$HOST_PIP" install -q --no-deps --target "$SITE" "${PLATFORMS[@]}" --python-version 3.11 \
            --only-binary=:all: "torch==$TORCH" filelock typing-extensions sympy mpmath \
            networkx jinja2 markupsafe fsspec setuptools
        "$HOST_PIP" install -q --target "$SITE/deps" "${PLATFORMS[@]}" --python-version 3.11 \
            --only-binary=:all: -r <(grep -E '^(numpy|transformers|tokenizers|safetensors|huggingface-hub|tqdm|pytest|pytest-timeout)==' "$REPO/requirements.txt")
    fi
    if [ ! -d "$SITE/extra/fastapi" ]; then
        # What the engine, server, structured-output, executor and benchmark tests need
        # beyond that, at requirements.txt's versions; llguidance at the newest with an
        # aarch64 wheel.
        "$HOST_PIP" install -q --target "$SITE/extra" "${PLATFORMS[@]}" --python-version 3.11 \
            --only-binary=:all: "llguidance>=1.6,<=$(pinned llguidance)" -r <(grep -E \
            '^(jinja2|fastapi|uvicorn|prometheus-client|openai|httpx|pytest-xdist|execnet|schemathesis|psutil|tenacity|tiktoken|aiohttp|cloudpickle|msgpack|protobuf|jsonschema|jsonschema-specifications|referencing|rpds-py|ray|matplotlib)==' \
            "$REPO/requirements.txt")
        "$HOST_PIP" install -q --no-deps --target "$SITE/extra" "${PLATFORMS[@]}" \
            --python-version 3.11 --only-binary=:all: "xgrammar==$(pinned xgrammar)" \
            "apache-tvm-ffi==$(pinned apache-tvm-ffi)"
    fi
    if [ ! -d "$SITE/extra/triton" ]; then
        # The Triton tests' interpreter (the Makefile's .triton/ holds the x86-64 build).
        "$HOST_PIP" install -q --no-deps --target "$SITE/extra" "${PLATFORMS[@]}" \
            --platform manylinux_2_27_aarch64 --python-version 3.11 --only-binary=:all: \
            -r "$REPO/requirements-triton.txt"
    fi
    # The emulated Python finds them through a .pth file, not PYTHONPATH: tests start
    # child processes with a PYTHONPATH of their own.
    mkdir -p "$ROOT/usr/lib/python3/dist-packages"
    printf '%s\n' "$SITE" "$SITE/deps" "$SITE/extra" > "$ROOT/usr/lib/python3/dist-packages/decodegraph-arm.pth"
    if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
        [ -e /proc/sys/fs/binfmt_misc/register ] ||
            mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc
        # The ELF header of an aarch64 executable, and the mask of the bytes that matter.
        printf '%s' ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:'"$(command -v qemu-aarch64-static)"':F' \
            > /proc/sys/fs/binfmt_misc/register
    fi
    cat > "$DIR/cxx" <<EOF
#!/usr/bin/env bash
args=()
for a in "\$@"; do
    case "\$a" in
        -march=native) args+=("-march=\${DG_ARM_MARCH:-armv8.2-a}") ;;
        /usr/include/python3.11*) args+=("$ROOT\$a") ;;
        -I/usr/include/python3.11*) args+=("-I$ROOT\${a#-I}") ;;
        *) args+=("\$a") ;;
    esac
done
exec aarch64-linux-gnu-g++ -idirafter $ROOT/usr/include "\${args[@]}"
EOF
    chmod +x "$DIR/cxx"
    ln -sf "$DIR/cxx" "$DIR/bin/c++"
    ln -sf "$ROOT/usr/bin/python3.11" "$DIR/bin/python"
    # torch's extension builder runs ninja: the host's (an x86-64 program runs natively).
    ln -sf "$(dirname "$HOST_PIP")/ninja" "$DIR/bin/ninja"
}

setup
export QEMU_LD_PREFIX=$ROOT
export PATH=$DIR/bin:$PATH
export CXX=$DIR/cxx
export PYTHONPATH=$REPO
# Its own build and Inductor caches, apart from the host's.
export XDG_CACHE_HOME=$DIR/cache
export TORCHINDUCTOR_CACHE_DIR=$DIR/inductor
cd "$REPO"
python -c 'import platform, torch; print("emulated:", platform.machine(), "torch", torch.__version__)'
# Left out, for what emulation lacks, not ARM: qemu-user takes MADV_HUGEPAGE and shows no
# huge pages nor their advice in smaps (the huge-page tests, and the placed parameters'
# check of their advice), the emulated Python has no pip (the
# wheel and console-script tests: no install), and Ray's cluster does not come up
# within its tests' time limits under emulation (its GCS and raylet time out).
NOT_EMULATED="not huge_page and not placed_parameters \
and not test_the_wheel_holds_every_native_source \
and not test_console_script_is_installed and not ray_executor and not RayExecutor \
and not ray_backend"
if [ $# -eq 0 ]; then
    set -- python -m pytest -q -rfs -p no:cacheprovider tests/native \
        tests/layers/test_activation.py tests/layers/test_layernorm.py \
        tests/layers/test_rotary_embedding.py tests/attention/test_torch_paged.py \
        tests/distributed/test_shm_all_reduce.py tests/platforms/test_platforms.py \
        -k "$NOT_EMULATED"
elif [ "$1" = --all ]; then
    set -- python -m pytest -q -rfs -p no:cacheprovider -n 2 --dist worksteal \
        --timeout 1800 tests -k "$NOT_EMULATED"
fi
exec "$@"
