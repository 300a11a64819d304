"""Static checks run in CI: ruff with the project's config, and the layer rule that the scheduler core (and the
simulator built on it) stays pure Python: no torch, no worker, model or server, even transitively."""

import importlib.util
import os
import subprocess
import sys

import pytest


def test_ruff_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed (it is in the dev extra: pip install -e '.[dev]')")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "pagedllm", "tests"], capture_output=True,
                       text=True, cwd=root)
    assert p.returncode == 0, p.stdout + p.stderr


def test_core_and_simulator_import_no_torch_or_upper_layers():
    code = ("import sys, pagedllm.core.scheduler, pagedllm.core.kv_cache_manager, pagedllm.sim.simulator\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'pagedllm.worker', "
            "'pagedllm.model', 'pagedllm.server', 'pagedllm.engine', 'pagedllm.layers')))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"the core imports {out}"
