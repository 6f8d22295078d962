#!/usr/bin/env bash
# Builds (once per machine) llama.cpp's OpenAI-compatible server, `llama-server`, from the
# llama.cpp sources vendored in the pinned llama-cpp-python source distribution on PyPI. The
# engine protocol tests serve a tiny generated model with it (tests/protocol/engine_support.py).
#
# Why llama-server and not `python -m llama_cpp.server`: llama-cpp-python's own server accepts
# only text prompts (`prompt: str | list[str]`) and reports sampled tokens as decoded strings, so
# it cannot continue a cut generation from token ids; llama-server accepts token-id prompts and
# returns each sampled token's id in its logprobs (docs/servers.md).
#
# The binary is cached under $ROLLOUT_ENGINE_CACHE (default ~/.cache/rollout-engines/<key>/bin)
# where <key> is a digest of the pinned version, the CMake flags, the compiler and this script:
# a rebuild happens only when one of them changes. The first build compiles llama.cpp (tens of
# minutes on two busy cores) under `nice -n 19`. Prints the bin directory as its last line.
# Usage: engines/build-llama-server.sh PYTHON   (a Python with pip, used to fetch the sdist)
set -euo pipefail

py="${1:?usage: build-llama-server.sh PYTHON}"
LLAMA_CPP_PYTHON_VERSION="0.3.36"
# A portable CPU build: no -march=native (the cache may outlive the CPU it was built on), -O1
# (a tiny model needs no fast kernels; it halves the compile), static libraries, no web UI
# download, no TLS.
CMAKE_FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG"
  "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF
  -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON)

for tool in cmake ninja c++; do
  command -v "$tool" >/dev/null 2>&1 || { echo "error: $tool is needed to build llama-server" >&2; exit 2; }
done
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
key="$({ echo "$LLAMA_CPP_PYTHON_VERSION ${CMAKE_FLAGS[*]}"; c++ --version | head -n 1; uname -m
  cat "$here/build-llama-server.sh"; } | sha256sum | cut -c1-16)"
root="${ROLLOUT_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-engines}/$key"
bin="$root/bin"

if [ -x "$bin/llama-server" ]; then
  echo "[engines] llama-server (llama.cpp from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION): cached ($bin/llama-server)" >&2
  echo "$bin"
  exit 0
fi
echo "[engines] llama-server (llama.cpp from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION): building (first build on this machine takes tens of minutes; log: $root/build.log) ..." >&2
start=$SECONDS
mkdir -p "$root/src"
{
  if [ ! -f "$root/src/.unpacked" ]; then
    "$py" -m pip download --quiet --no-deps --no-binary :all: \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$root/src"
    tar -xzf "$root/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$root/src"
    touch "$root/src/.unpacked"
  fi
  cmake -S "$root/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp" -B "$root/build" "${CMAKE_FLAGS[@]}"
  nice -n 19 cmake --build "$root/build" --target llama-server -j "$(nproc)"
} >"$root/build.log" 2>&1 || { echo "[engines] build failed; log: $root/build.log" >&2; tail -n 30 "$root/build.log" >&2; exit 1; }
mkdir -p "$bin"
cp "$root/build/bin/llama-server" "$bin/llama-server.tmp"
mv "$bin/llama-server.tmp" "$bin/llama-server"
rm -rf "$root/build" "$root/src"
echo "[engines] llama-server: built in $((SECONDS - start)) s ($bin/llama-server)" >&2
echo "$bin"
