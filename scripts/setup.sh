#!/usr/bin/env bash
# Make .venv with minivllm and its test tools (idempotent). The pin keeps pip from moving torch
# (this project's machines hold its CPU wheel in pip's local folder; elsewhere install the CPU
# build first, see README.md). triton 3.7.1 is the release torch 2.13 pairs with (its
# interpreter runs our kernels on CPU in the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 triton==3.7.1 -e '.[dev]'
