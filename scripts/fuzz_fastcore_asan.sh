#!/usr/bin/env bash
# Fuzz the compiled snapshot decoder under AddressSanitizer (not part of the test suite: minutes).
#   bash scripts/fuzz_fastcore_asan.sh [SEED] [COUNT]
# Builds memory_audit/_fastcore.c with -fsanitize=address into a temporary copy of the package,
# then decodes COUNT corrupted copies (flipped bytes, cuts, splices, duplicated runs) of the
# committed example snapshots and of the foreign fixtures, and replays random traces. Any
# memory error stops it with ASan's report.
set -euo pipefail
cd "$(dirname "$0")/.."
seed=${1:-1}; count=${2:-3000}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/memory_audit" && cp memory_audit/*.py "$tmp/memory_audit/"
gcc -O1 -g -fsanitize=address -fno-omit-frame-pointer -shared -fPIC $(python3-config --includes) \
    memory_audit/_fastcore.c -o "$tmp/memory_audit/_fastcore$(python3-config --extension-suffix)"
LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
    python scripts/fuzz_fastcore.py "$tmp" "$seed" "$count"
