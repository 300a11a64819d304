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
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "pagedllm", "tests", "tools"], capture_output=True,
                       text=True, cwd=root)
    assert p.returncode == 0, p.stdout + p.stderr


def test_core_and_simulator_import_no_torch_or_upper_layers():
    # the simulator reads checkpoints through the model's pure-data modules (model.arch, model.archs: the loader's own
    # reading of a config, no torch); nothing else of the model
    code = ("import sys, pagedllm.core.scheduler, pagedllm.core.kv_cache_manager, pagedllm.sim.simulator, "
            "pagedllm.sim.model_profile\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'pagedllm.worker', "
            "'pagedllm.server', 'pagedllm.engine', 'pagedllm.layers', 'pagedllm.quant', 'pagedllm.kernels')) or "
            "(m.startswith('pagedllm.model.') and not m.startswith('pagedllm.model.arch')))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"the core imports {out}"


# ---------------------------------------------------------------------------------------------- import layering
# Which pagedllm packages each layer may import (docs/architecture.md draws the same table). A module is named by
# its first component under pagedllm/ ("config", "core", "worker", ...); tier-0 modules import stdlib only.
TIER0 = {"config", "sampling_params", "request", "outputs", "errors", "routing"}
LOW = TIER0 | {"gguf_file", "kernels", "layers", "quant", "model", "distributed", "sample", "spec"}
MAY_IMPORT = {
    **{m: TIER0 for m in TIER0},
    "core": TIER0,
    "sim": TIER0 | {"core", "gguf_file", "model"},  # model.arch / model.archs only (the no-torch test above)
    "reference": TIER0,  # transformers' own reading of a GGUF file (torch/transformers loaded on use): the HF baseline
    "gguf_file": TIER0,  # the GGUF header reader (numpy, gguf), shared by the model loader and the simulator
    "kernels": TIER0,
    "quant": TIER0 | {"gguf_file", "kernels"},  # gguf_file: the block types' table
    "distributed": TIER0 | {"kernels", "model"},
    "layers": TIER0 | {"kernels", "quant", "distributed"},
    "sample": TIER0 | {"kernels"},
    "model": TIER0 | {"gguf_file", "kernels", "layers", "quant", "distributed"},
    "spec": TIER0 | {"kernels", "layers", "quant", "model", "sample", "distributed"},
    "worker": LOW,
    "quantize": LOW | {"worker", "engine"},
    "engine": LOW | {"core", "worker"},
    "metrics": TIER0 | {"engine"},
    "server": TIER0 | {"engine", "metrics"},  # HTTP over the engine's API: no model, layers, quant, worker or core
    "eval": LOW | {"core", "worker", "engine", "reference"},
    "bench": LOW | {"core", "worker", "engine", "metrics", "server", "eval", "quantize", "reference"},
}
# Imports inside a function are allowed only for optional heavy third-party modules (a command that does not need
# them starts without them), and in the dispatchers that load a subcommand's modules on demand (the api_server module:
# its engine imports come after the verdict hash has started, ``quant.verdicts.start_sha256_for_command``).
LAZY_OK = {"torch", "transformers", "tqdm", "matplotlib", "numpy", "hypothesis", "schemathesis", "gguf",
           "safetensors", "uvicorn", "psutil", "pydoc_data", "sentence_transformers",
           "llguidance"}  # llguidance.hf imports transformers: a server start does not need it before a constraint
LAZY_DISPATCHERS = {"pagedllm/__init__.py", "pagedllm/cli/main.py", "pagedllm/entrypoints/openai/api_server.py"}


def _library_modules():
    import ast

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for d, _, files in os.walk(os.path.join(root, "pagedllm")):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                with open(path) as fh:
                    yield rel, ast.parse(fh.read())


def _imports(tree):
    """-> [(module name, inside a function?)] for every import statement (relative ones resolved loosely)."""
    import ast

    out = []

    def visit(node, in_fn):
        for child in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name, in_fn) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.extend((f"{child.module}.{a.name}" if child.module == "pagedllm" else child.module, in_fn)
                           for a in child.names)
            visit(child, fn)

    visit(tree, False)
    return out


def test_no_imports_inside_functions_except_optional_heavy_ones():
    bad = []
    for rel, tree in _library_modules():
        if rel in LAZY_DISPATCHERS:
            continue
        for name, in_fn in _imports(tree):
            if in_fn and name.split(".")[0] not in LAZY_OK:
                bad.append(f"{rel}: import {name}")
    assert not bad, "imports inside functions (move them to the top):\n" + "\n".join(bad)


def test_layers_import_only_downward():
    bad = []
    for rel, tree in _library_modules():
        parts = rel[len("pagedllm/"):].removesuffix(".py").split("/")
        layer = parts[0]
        if layer in ("__init__", "cli", "entrypoints"):
            continue
        allowed = MAY_IMPORT.get(layer)
        assert allowed is not None, f"{rel}: layer {layer!r} is not in the table of test_lint.py"
        for name, _ in _imports(tree):
            if not name.startswith("pagedllm.") and name != "pagedllm":
                if layer in TIER0 | {"core"} and name.split(".")[0] not in sys.stdlib_module_names:
                    bad.append(f"{rel}: {layer} imports third-party {name}")
                continue
            target = name.split(".")[1] if "." in name else "__init__"
            if target == "__version__":  # the package root's version string: any layer may read it
                continue
            if target != layer and target not in allowed:
                bad.append(f"{rel}: {layer} imports {name}")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)
