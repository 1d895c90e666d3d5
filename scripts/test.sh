#!/usr/bin/env bash
# Set up (once) and run the test suite: unit, integration (tiny real model on CPU), fault injection,
# notebooks (executed headless) and the real-browser dashboard test (Chromium from Debian packages).
# GPU tests are skipped without CUDA. Extra arguments go to pytest (e.g. tests/unit -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/ui_deps.sh || echo "warning: browser test dependencies could not be installed; tests/ui will skip"
exec .venv/bin/python -m pytest -q --durations=15 "$@"
