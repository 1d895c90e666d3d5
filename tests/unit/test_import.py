import os
import subprocess
import sys


def test_import_is_light_and_side_effect_free():
    code = (
        "import os, sys; before = dict(os.environ); import art_nb; "
        "heavy = [m for m in ('torch', 'transformers', 'vllm', 'unsloth', 'ipywidgets', 'peft', 'matplotlib') "
        "if m in sys.modules]; assert not heavy, heavy; assert dict(os.environ) == before; "
        "assert art_nb.LocalBackend.__name__ == 'LocalBackend'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
