#!/usr/bin/env bash
# Set up (once) and run the main job: SmolLM2-135M learns tic-tac-toe with GRPO + LoRA on this CPU.
# Extra arguments go to `art-nb demo` (see `art-nb demo --help`), e.g. --steps 20.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/art-nb demo "$@"
