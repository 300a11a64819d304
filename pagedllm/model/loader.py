"""Reads model weights and hyper-parameters from GGUF files or HuggingFace-style directories.

Weights come out under the engine's own names (see ``CausalLM``), as float32 numpy/torch arrays, with
llama's GGUF q/k rows un-permuted back to the HuggingFace rotary layout.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.model.arch import ModelArchConfig, config_from_gguf, config_from_hf
from pagedllm.model.archs import (ARCHS, GGUF_EXPERT_OLD, GGUF_EXPERTS, HF_EXPERT, HF_EXPERT_PART, HF_MTP_NAMES,
                                   HF_STACKED_EXPERTS, HF_TYPES, GGUFMeta, hf_eos)
from pagedllm.gguf_file import BLOCK_TYPES, GGUFFile
from pagedllm.quant import gguf_blocks
from pagedllm.quant.formats import reorder_rows

logger = logging.getLogger(__name__)


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (interleaved rotary pairs -> HuggingFace's half split)."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


# GGUF block types the loader decodes to floats itself (blocks of 32): bytes before a block's codes (f16 d; Q4_1:
# and f16 m), from the block types' table
_BLOCK_HEAD = {name: t.head for name, t in BLOCK_TYPES.items() if t.head}


def _gguf_blocks(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(d, m, codes) of a tensor's Q4_0 / Q4_1 / Q8_0 blocks, a row per output row: float32 d (rows, blocks), float32
    m (Q4_1, else None), codes (rows, 32 * blocks): 4-bit values as uint8 (in a block, the low nibbles are elements
    0-15 and the high nibbles 16-31), 8-bit ones as int8. Values: Q4_1 d*q + m, Q4_0 d*(q - 8), Q8_0 d*s."""
    head = _BLOCK_HEAD[kind]
    rows = int(np.prod(data.shape[:-1]))
    blocks = np.ascontiguousarray(data).reshape(rows, -1, BLOCK_TYPES[kind].nbytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else None
    qs = blocks[..., head:]
    codes = qs.view(np.int8) if kind == "Q8_0" else np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    return d, m, codes.reshape(rows, -1)


def _dequantize(data: np.ndarray, ttype) -> np.ndarray:
    """Float32 values of a GGUF tensor. Q4_0, Q4_1 and Q8_0 blocks are decoded with torch, by the same float32
    operations as gguf's numpy de-quantization (``d*q + m``, ``d*(q - 8)``, ``s*d``), so to the same numbers (a test
    compares every tensor of the default file) and faster (docs/history.md#figures-from-code-comments); other types go
    through gguf."""
    import gguf

    kind = ttype.name
    if kind not in _BLOCK_HEAD:
        return gguf.quants.dequantize(data, ttype).astype(np.float32, copy=False)
    d, m, codes = _gguf_blocks(data, kind)
    dt = torch.from_numpy(d).unsqueeze(-1)
    q = torch.from_numpy(codes).reshape(*d.shape, 32).float()
    if kind == "Q8_0":
        out = q * dt
    elif kind == "Q4_1":
        out = dt * q + torch.from_numpy(m).unsqueeze(-1)
    else:
        out = dt * (q - 8)
    return out.reshape(*data.shape[:-1], -1).numpy()


def open_gguf(path: str):
    """The file's header and tensors (``GGUFFile``), or a ValueError naming the file when it is not a whole GGUF
    file (bad magic, a header that does not parse, tensor data past the end of a truncated file)."""
    size = os.path.getsize(path)
    try:
        reader = GGUFFile(path)
    except Exception as e:  # noqa: BLE001 - whatever the parser trips on, the file is what is wrong
        raise ValueError(f"{path}: not a readable GGUF file ({size} bytes): {type(e).__name__}: {e}") from None
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ValueError(f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte {end}, the file has "
                             f"{size} bytes")
    return reader


@dataclass
class _ExpertSlice:
    """Expert ``e`` of a GGUF tensor that stacks all of a layer's experts: read as a tensor of its own."""

    name: str
    data: np.ndarray
    tensor_type: object
    shape: tuple
    n_bytes: int
    data_offset: int

    @classmethod
    def of(cls, t, e: int, n: int) -> "_ExpertSlice":
        size = int(t.n_bytes) // n
        return cls(f"{t.name}[{e}]", t.data[e], t.tensor_type, tuple(t.shape[:2]), size, int(t.data_offset) + e * size)


def load_gguf(path: str, native_q4: bool = False, native_q8: bool = False, native: bool = False,
              lazy: bool = False) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """``native``: keep every tensor of a block type the block kernel runs (``quant.gguf_blocks.DECODERS``: Q4_0 ..
    Q8_0, Q2_K .. Q6_K, IQ4_NL/XS) as packed codes with the file's own scales, never as float32 weights;
    ``native_q4``: only Q4_0/Q4_1 tensors other than the embedding (torch's int4 kernel path); ``native_q8``: also
    Q8_0 tensors, the embedding too. Other tensors (F32, F16, BF16, the rest) are float32. ``lazy`` (with
    ``native``): a ``LazyWeights`` dict whose block tensors decode as they are read (the model packs them one by
    one), each one's pages of the memory map released once decoded: the load then holds little more than the
    packed weights."""
    reader = open_gguf(path)
    arch = reader.get("general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"{path}: unsupported architecture {arch!r}; supported: {tuple(ARCHS)}")
    spec = ARCHS[arch]
    by_name = {t.name: t for t in reader.tensors}
    meta = GGUFMeta(arch, reader.get, set(by_name), lambda name: _dequantize(by_name[name].data,
                                                                            by_name[name].tensor_type))
    cfg = config_from_gguf(meta, path)
    per_layer, whole = spec.gguf_layer_names, spec.gguf_whole_names
    n_head, n_kv = cfg.num_heads, cfg.num_kv_heads
    tasks = []
    for t in reader.tensors:
        if t.name in whole:
            name = whole[t.name]
        elif t.name.startswith("blk.") and (m := GGUF_EXPERT_OLD.fullmatch(t.name.split(".", 2)[2])) is not None:
            tasks.append((f"layers.{t.name.split('.')[1]}.experts.{m[2]}.{m[1]}", t))  # older: one per expert
        elif t.name.startswith("blk.") and t.name.split(".", 2)[2] in GGUF_EXPERTS:
            _, idx, rest = t.name.split(".", 2)
            tasks += [(f"layers.{idx}.experts.{e}.{GGUF_EXPERTS[rest]}", _ExpertSlice.of(t, e, cfg.num_experts))
                      for e in range(cfg.num_experts)]
            continue
        elif t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest not in per_layer:
                continue  # not a weight the layers read
            name = f"layers.{idx}.{per_layer[rest]}"
        else:
            continue
        tasks.append((name, t))

    def one(task):
        name, t = task
        rotary = spec.gguf_permuted_qk and name.endswith((".q", ".k", ".q_bias", ".k_bias"))
        heads = n_head if ".q" in name else n_kv
        kind = t.tensor_type.name
        if (native and kind in gguf_blocks.DECODERS) or (
                native_q4 and kind in ("Q4_0", "Q4_1") and t.name != "token_embd.weight") or (
                native_q8 and kind == "Q8_0"):
            post = None
            if rotary:
                post = lambda qw: reorder_rows(qw, lambda x: torch.from_numpy(np.ascontiguousarray(  # noqa: E731
                    _unpermute_rotary(x.numpy(), heads))))
            if lazy and native:
                rows = int(np.prod(t.data.shape[:-1]))
                return gguf_blocks.LazyBlocks(t.data, kind, (rows, int(t.shape[0])), post,
                                              lambda lo=0, hi=None: reader.release(t, lo, hi))
            qw = gguf_blocks.decode(t.data, kind)
            return qw if post is None else post(qw)
        arr = _dequantize(t.data, t.tensor_type)
        if rotary:
            arr = _unpermute_rotary(arr, heads)
        return torch.from_numpy(np.array(arr, copy=not arr.flags.writeable or not arr.flags.c_contiguous))

    # in the order a model builds itself: the layers, then the embedding and head
    tasks.sort(key=lambda nt: (0, int(nt[0].split(".")[1])) if nt[0].startswith("layers.") else (1, 0))
    # tensors decode on every core: numpy releases the GIL in its array operations
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        weights = dict(zip((name for name, _ in tasks), pool.map(one, tasks)))
    if lazy and native:
        weights = gguf_blocks.LazyWeights(weights)
    counts: dict[str, list[int]] = {}
    for _, t in tasks:
        c = counts.setdefault(t.tensor_type.name, [0, 0])
        c[0] += 1
        c[1] += int(t.n_bytes)
    logger.info("%s: %s", os.path.basename(path), ", ".join(
        f"{kind} {n} tensors {b / 2**20:.1f} MiB {'native' if native and kind in gguf_blocks.DECODERS else 'float'}"
        for kind, (n, b) in sorted(counts.items(), key=lambda kv: -kv[1][1])))
    return cfg, weights


# multimodal checkpoints whose text model is served: model_type -> the text config's
MULTIMODAL = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen3_5": "qwen3_5_text",
              "qwen3_5_moe": "qwen3_5_moe_text"}


def load_hf_dir(path: str) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    if hf.get("model_type") in MULTIMODAL:  # its text model, transformers' defaults filled in
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(path).text_config.to_dict()
        hf = text | {"eos_token_id": text.get("eos_token_id") or hf.get("eos_token_id"),
                     "model_type": MULTIMODAL[hf["model_type"]]}
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):  # its eos ids (e.g. gemma's <end_of_turn>) end generation too
        with open(gen) as f:
            gen_eos = json.load(f).get("eos_token_id")
        if gen_eos is not None:
            ids = hf_eos(hf)
            more = [i for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos]) if i not in (ids[0], *ids[1])]
            hf = hf | {"eos_token_id": [i for i in (ids[0], *ids[1], *more) if i is not None]}
    model_type = hf.get("model_type")
    if model_type not in HF_TYPES:
        raise ValueError(f"{path}: unsupported model_type {model_type!r}; supported: {tuple(HF_TYPES)}")
    spec = HF_TYPES[model_type]
    cfg = config_from_hf(hf)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    per_layer, whole, prefix = spec.hf_layer_names, spec.hf_whole_names, spec.hf_layer_prefix
    weights: dict[str, torch.Tensor] = {}
    for fname in files:
        for name, t in load_file(os.path.join(path, fname)).items():
            # a multimodal checkpoint's text model, in either naming
            name = name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
            name = name.replace("language_model.lm_head.", "lm_head.").removeprefix("bert.")
            if name.startswith(("layers.", "embed_tokens.", "norm.")):  # a bare model (sentence-transformers saves
                name = "model." + name  # the AutoModel, e.g. Gemma3TextModel, without the causal LM's prefix)
            if name in whole:
                key = whole[name]
            elif name in HF_MTP_NAMES:
                key = HF_MTP_NAMES[name]
            elif name.startswith((prefix, "mtp.layers.")):  # a decoder layer, or a multi-token prediction layer's
                out, (idx, rest) = ("layers", name[len(prefix):].split(".", 1)) if name.startswith(prefix) else (
                    "mtp.layers", name[len("mtp.layers."):].split(".", 1))
                if spec.split_hf is not None and (parts := spec.split_hf(rest, t)) is not None:
                    weights.update({f"{out}.{idx}.{k}": (v.float() if v.is_floating_point() else v).contiguous()
                                    for k, v in parts.items()})
                    continue
                experts = rest[len(spec.hf_experts):] if spec.hf_experts and rest.startswith(spec.hf_experts) else None
                if experts is not None and (m := HF_EXPERT.fullmatch(experts)) is not None:
                    key = f"{out}.{idx}.experts.{m[1]}.{HF_EXPERT_PART[m[2]]}"
                elif experts in HF_STACKED_EXPERTS:
                    for e, w in enumerate(t.float().unbind(0)):
                        weights[f"{out}.{idx}.experts.{e}.{HF_STACKED_EXPERTS[experts]}"] = w.contiguous()
                    continue
                elif rest not in per_layer:
                    continue
                else:
                    key = f"{out}.{idx}.{per_layer[rest]}"
            else:
                continue
            t = t.float()
            if spec.hf_norm_plus_one and key.endswith("norm"):
                t = 1.0 + t  # (1 + w) as the reference computes it, in float32: GGUF files store this
            weights[key] = t
    for key in [k for k in weights if k.endswith("_blocks")]:  # MXFP4 (gpt-oss as released): codes and scales
        name = key.removesuffix("_blocks")
        weights[name] = gguf_blocks.mxfp4_ocp(weights.pop(key), weights.pop(name + "_scales"))
    return cfg, weights


def load_model_files(path: str, native_q4: bool = False, native_q8: bool = False, native: bool = False,
                     lazy: bool = False) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """Float weights of a GGUF file or HF-style directory (GGUF 4-/8-bit blocks kept packed with ``native_q4`` /
    ``native_q8``). Quantized checkpoints (``pagedllm quantize``) are read by ``pagedllm.model.weights``."""
    if os.path.isdir(path):
        return load_hf_dir(path)
    if path.endswith(".gguf"):
        return load_gguf(path, native_q4, native_q8, native, lazy)
    raise ValueError(f"{path}: expected a .gguf file or a directory with config.json and *.safetensors")
