"""`pagedllm quantize`: full-precision model in, quantized checkpoint out (RTN, AWQ or GPTQ; 4 or 8 bits)."""

from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from pagedllm.config import resolve_model_path
from pagedllm.engine.tokenizer import load_tokenizer
from pagedllm.model.decoder import CausalLM
from pagedllm.model.loader import load_model_files
from pagedllm.quant.checkpoint import save_checkpoint
from pagedllm.quant.policy import LINEAR_TYPES, QuantPolicy, quantize_weight
from pagedllm.quant.texts import python_doc_text, token_chunks
from pagedllm.quantize.awq import awq_quantize
from pagedllm.quantize.calibrate import collect_stats
from pagedllm.quantize.gptq import gptq_quantize

logger = logging.getLogger(__name__)

METHODS = ("rtn", "awq", "gptq")


def default_policy(bits: int, group_size: int, symmetric: bool) -> QuantPolicy:
    """4-bit: attention and MLP int4, LM head (and a tied embedding) int8; 8-bit: everything int8."""
    body = "int4" if bits == 4 else "int8"
    return QuantPolicy(attn=body, mlp=body, lm_head="int8", embed="int8", group_size=group_size,
                       symmetric=symmetric)


def quantize_model(model_path: str, method: str, policy: QuantPolicy, calib_sequences: list[list[int]] | None,
                   progress: bool = True):
    """-> (arch, weights dict ready for ``save_checkpoint`` / ``CausalLM``, report dict)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}")
    t0 = time.perf_counter()
    arch, raw = load_model_files(resolve_model_path(model_path))
    if arch.num_experts:
        raise ValueError(f"{model_path}: pagedllm quantize does not handle mixture-of-experts models yet; "
                         "serve the GGUF file's own blocks instead")
    model = CausalLM(arch, raw, torch.device("cpu"), torch.float32)
    del raw
    linears = model.linears()  # the layers' linears, as the model names them (layers.{i}.qkv, ...)
    linear_names = [n for n in linears if n.startswith("layers.")]
    targets = [n for n in linear_names if policy.scheme(LINEAR_TYPES[n.rsplit(".", 1)[1]]) in ("int4", "int8")]
    stats = {}
    if method != "rtn" and targets:
        if not calib_sequences:
            raise ValueError(f"{method} needs calibration text")
        stats = collect_stats(model, calib_sequences, targets, want_hessian=method == "gptq")
    weights: dict = {"norm": model.norm}
    report: dict = {"layers": {}}
    for n in tqdm(linear_names, desc=f"quantize ({method})", unit="layer", disable=not progress):
        lin = linears[n]
        scheme = policy.scheme(LINEAR_TYPES[n.rsplit(".", 1)[1]])
        w = lin.weight.float()
        if scheme in ("int4", "int8") and method != "rtn":
            bits = 4 if scheme == "int4" else 8
            gs = policy.group_size if bits == 4 else w.shape[1]
            sym = policy.symmetric if bits == 4 else True
            if method == "awq":
                qw, info = awq_quantize(w, stats[n], bits, gs, sym)
            else:
                qw, info = gptq_quantize(w, stats[n].hessian, bits, gs, sym)
            report["layers"][n] = info
        else:
            qw = quantize_weight(w, scheme, policy)
        weights[n] = qw
        if lin.bias is not None:  # (only q/k/v have biases)
            weights[n + "_bias"] = lin.bias
    for i, layer in enumerate(model.layers):
        for name, norm in layer.norms().items():
            weights[f"layers.{i}.{name}"] = norm
    # embedding and LM head: round to nearest (salience scaling would break a tied table)
    head = model.lm_head.weight.float()
    weights["lm_head"] = quantize_weight(head, policy.lm_head, policy)
    if arch.tie_word_embeddings and policy.lm_head == "int8" and policy.embed == "int8":
        weights["embed"] = weights.pop("lm_head")  # one int8 table for both
    elif arch.tie_word_embeddings and policy.lm_head == "none":
        weights["embed"] = weights.pop("lm_head")
    else:
        weights["embed"] = quantize_weight(model.embed.weight.float(), policy.embed, policy)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return arch, weights, report


def quantize_to_dir(model_path: str, method: str, bits: int, policy: QuantPolicy, out: str,
                    calib_text: str | None = None, calib_label: str = "pydoc_data.topics (calib split)",
                    calib_tokens: int = 8192, calib_seq_len: int = 256, progress: bool = True):
    """Calibrate (on ``calib_text``, default the calibration half of Python's docs), quantize and write a
    checkpoint with the tokenizer to ``out``. -> (quantization info recorded in the checkpoint, report)."""
    path = resolve_model_path(model_path)
    tok = load_tokenizer(path)
    text = calib_text if calib_text is not None else python_doc_text("calib")
    calib = token_chunks(tok, text, calib_seq_len, calib_tokens)
    if method != "rtn" and not calib:
        raise ValueError(f"the calibration text has fewer than {calib_seq_len} tokens")
    arch, weights, report = quantize_model(path, method, policy, calib, progress)
    info = {"method": method, "bits": bits, "group_size": policy.group_size if bits == 4 else -1,
            "symmetric": policy.symmetric or bits == 8, "policy": policy.to_dict(), "source": path,
            "seconds": report["seconds"],
            "calibration": {"file": calib_label, "sequences": len(calib), "seq_len": calib_seq_len}}
    save_checkpoint(out, arch, weights, info, tok)
    return info, report
