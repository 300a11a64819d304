"""What every benchmark command shares: the engine flags it exposes (model, dtype, max length), the workload flags
(prompts, output length), and writing its results as JSON."""

from __future__ import annotations

import argparse
import json
import os

from pagedllm.config import DTYPE_CHOICES


def add_model_arg(p: argparse.ArgumentParser, default: str | None = None,
                  help_text: str = "model path (default: the embedded SmolLM2-135M GGUF)") -> None:
    p.add_argument("--model", default=default, help=help_text)


def add_dtype_arg(p: argparse.ArgumentParser, default: str = "auto") -> None:
    p.add_argument("--dtype", default=default, choices=DTYPE_CHOICES,
                   help="pagedllm's dtype (auto: the fastest path measured on this machine; float32: exact HF)")


def add_workload_args(p: argparse.ArgumentParser, num_prompts: int | None = 32, output_len: int | None = 128,
                      prompts_file_required: bool = False) -> None:
    """--num-prompts / --output-len / --prompts-file; a default of None makes the flag required (phase runners)."""
    p.add_argument("--num-prompts", type=int, default=num_prompts, required=num_prompts is None)
    p.add_argument("--output-len", type=int, default=output_len, required=output_len is None,
                   help="output tokens per request")
    p.add_argument("--prompts-file", default=None, required=prompts_file_required,
                   help="JSONL with a 'prompt' field (default: the shipped W1 set)")


def add_result_json_arg(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--result-json", default=default, help="also write the results as JSON here")


def write_json(path: str | None, obj, indent: int = 2) -> None:
    """Write ``obj`` as JSON to ``path`` (its folder made if needed); nothing when ``path`` is None."""
    if not path:
        return
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent, default=str)
        f.write("\n")
