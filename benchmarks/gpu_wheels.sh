#!/usr/bin/env bash
# The wheels the GPU machine lacks for benchmarks/gpu_checks.sh's test steps (pytest, hypothesis
# and what they need; Python 3.12 there), downloaded here into .whl/ (git-ignored), which a
# device call then carries: run(..., carry=[".whl"]). A new checkout has no .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
rm -rf .whl && mkdir -p .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pytest iniconfig pluggy packaging hypothesis sortedcontainers
ls .whl
