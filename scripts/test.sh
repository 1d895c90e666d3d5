#!/usr/bin/env bash
# Set up (once) and run the test suite: unit, integration (tiny real model on CPU), notebooks.
# GPU tests are skipped without CUDA. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
