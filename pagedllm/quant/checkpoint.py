"""Quantized checkpoints: a directory with ``model.safetensors`` (engine weight names; quantized weights split
into ``.codes`` / ``.scales`` / ``.zeros`` / ``.input_scale``, 4-bit codes packed two per byte), ``quant_config.json``
(architecture, method, bits, group size, per-layer-type policy, per-tensor formats) and the tokenizer files.

Written by ``pagedllm quantize`` (``pagedllm.quantize``), read at load time (``pagedllm.model.weights``): the format
lives here, below the model, so both sides share it. The architecture is stored as a plain dict (the fields of
``pagedllm.model.arch.ModelArchConfig``)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch

from pagedllm.quant.formats import Fp8Weight, QuantizedWeight

CONFIG_NAME = "quant_config.json"


def is_quantized_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, CONFIG_NAME))


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    out = torch.empty(n, half * 2, dtype=torch.uint8)
    out[:, 0::2] = packed & 0xF
    out[:, 1::2] = packed >> 4
    return out


def save_checkpoint(out_dir: str, arch, weights: dict, quant_info: dict, tokenizer=None) -> None:
    """``arch``: a ``ModelArchConfig`` (any dataclass; stored as its fields)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    formats: dict[str, dict] = {}
    for name, w in weights.items():
        if isinstance(w, QuantizedWeight):
            tensors[name + ".codes"] = _pack4(w.codes) if w.bits == 4 else w.codes.contiguous()
            tensors[name + ".scales"] = w.scales.float().contiguous()
            if w.zeros is not None:
                tensors[name + ".zeros"] = w.zeros.float().contiguous()
            if w.input_scale is not None:
                tensors[name + ".input_scale"] = w.input_scale.float().contiguous()
            formats[name] = {"format": "int", "bits": w.bits, "group_size": w.group_size, "shape": list(w.shape),
                             "offset_form": w.offset_form}
        elif isinstance(w, Fp8Weight):
            tensors[name + ".data"] = w.data.contiguous()
            tensors[name + ".scales"] = w.scales.float().contiguous()
            formats[name] = {"format": "fp8_e4m3", "shape": list(w.shape)}
        else:
            tensors[name] = w.float().contiguous()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    cfg = {"arch": asdict(arch), "quantization": quant_info, "tensors": formats}
    with open(os.path.join(out_dir, CONFIG_NAME), "w") as f:
        json.dump(cfg, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def read_quant_info(path: str) -> dict:
    with open(os.path.join(path, CONFIG_NAME)) as f:
        return json.load(f)["quantization"]


def load_checkpoint(path: str):
    """-> (architecture fields (a dict for ``ModelArchConfig``), weights dict with QuantizedWeight / Fp8Weight
    values, quantization info)."""
    from safetensors.torch import load_file

    with open(os.path.join(path, CONFIG_NAME)) as f:
        cfg = json.load(f)
    arch = dict(cfg["arch"])
    flat = load_file(os.path.join(path, "model.safetensors"))
    weights: dict = {}
    for name, fmt in cfg["tensors"].items():
        if fmt["format"] == "fp8_e4m3":
            weights[name] = Fp8Weight(flat.pop(name + ".data"), flat.pop(name + ".scales"))
            continue
        codes = flat.pop(name + ".codes")
        if fmt["bits"] == 4:
            codes = _unpack4(codes)
        weights[name] = QuantizedWeight(codes, flat.pop(name + ".scales"), flat.pop(name + ".zeros", None),
                                        fmt["bits"], fmt["group_size"], flat.pop(name + ".input_scale", None),
                                        fmt.get("offset_form", False))
    weights.update(flat)
    return arch, weights, cfg["quantization"]
