#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: generation with the engine. With no arguments it
# runs the built-in tiny demo model (random weights: meaningless text); pass CLI arguments to
# choose a checkpoint, e.g. `bash scripts/demo.sh --model path/to/Qwen3-0.6B --prompt "Hi"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
  set -- --demo --prompt "Hello, my name is" --max-tokens 32
fi
exec .venv/bin/minivllm generate "$@"
