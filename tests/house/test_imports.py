"""`import rl_lightning` and every submodule work without vllm or flash-attn being imported."""

import pkgutil
import subprocess
import sys

import rl_lightning

MODULES = sorted(m.name for m in pkgutil.walk_packages(rl_lightning.__path__, "rl_lightning."))


def test_every_module_imports_without_optional_gpu_deps():
    assert len(MODULES) >= 15, MODULES  # catches a broken walk that would make this test vacuous
    code = (
        "import importlib, sys\n"
        f"for name in {MODULES!r}:\n"
        "    if name.endswith('__main__'): continue\n"
        "    importlib.import_module(name)\n"
        "heavy = [m for m in ('vllm', 'flash_attn', 'ring_flash_attn') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print('ok', len(sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")
