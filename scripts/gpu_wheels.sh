#!/usr/bin/env bash
# Fill .whl/ with the wheels the lent GPU machines' image lacks (it cannot reach a package index):
# crc32c and google-crc32c (the L3's CRC-32C engines; without them the stores fall back to zlib's CRC-32). The image's
# python3 is CPython 3.12 on x86-64. scripts/gpu_check.sh installs whatever .whl/ holds into a
# scratch site; name `.whl` in the device call's carry. .whl/ is ignored by git.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "google-crc32c==1.9.0" "crc32c==2.9.post0"
ls -l .whl
