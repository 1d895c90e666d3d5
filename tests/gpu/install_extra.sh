#!/bin/bash
# On the GPU machine (no network): install the wheels carried in .gpu/extra/ that the machine's packages lack
# (LangGraph and LangChain for the tool-agent notebook and what they need, dashscope for Qwen's vocabulary in
# tests/qwen25.py, lm-format-enforcer and interegular, which vLLM 0.25 imports when a request forces a tool
# call: without them test_qwen25_gpu.py gets a 500, "No module named 'lmformatenforcer'"). A wheel whose module the machine already imports is skipped, so nothing the staged vLLM
# and Unsloth run on is shadowed. Fill it with
#   pip download PACKAGE --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 -d .gpu/extra
ls .gpu/extra/*.whl >/dev/null 2>&1 || exit 0
missing=()
for wheel in .gpu/extra/*.whl; do
  module=$(basename "$wheel" | cut -d- -f1)
  python3 -c "import $module" >/dev/null 2>&1 || missing+=("$wheel")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing ${#missing[@]} carried wheels: $(for w in "${missing[@]}"; do basename "$w" | cut -d- -f1; done | tr '\n' ' ')"
python3 -m pip install -q --no-deps --no-index --target /root/usite "${missing[@]}" || echo "carried wheels failed"
