#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests "$@"
