"""What ``--quantization`` means at load time, for any model path.

- a ``pagedllm quantize`` checkpoint directory: its packed weights (``--quantization`` may name its method or be
  left out; another value is an error);
- ``int8`` / ``fp8``: quantize a full-precision model at load time (round to nearest, per-layer-type policy);
- ``gguf``: keep a GGUF file's blocks packed (exactly the file's numbers); on CPU with the fused kernels every block
  type of ``quant.gguf_blocks`` (Q4_0 .. Q8_0, the K-quants, IQ4_NL/XS; the embedding too) runs through the
  ``qlinear`` block kernel, elsewhere Q4_0/Q4_1 run through torch's int4 kernel with the embedding dequantized and
  an int8 LM head;
- ``awq`` / ``gptq`` / ``rtn`` without such a checkpoint: an error pointing to ``pagedllm quantize``;
- none, for an HF directory that stores blocks itself (gpt-oss's MXFP4 experts): those weights as stored
  (``CHECKPOINT_BLOCKS``), which the block kernel runs under ``--dtype auto`` (a float dtype given decodes them)."""

from __future__ import annotations

from pagedllm.config import QUANTIZATION_CHOICES
from pagedllm.model.arch import ModelArchConfig
from pagedllm.model.loader import load_model_files
from pagedllm.quant.checkpoint import is_quantized_checkpoint, load_checkpoint
from pagedllm.quant.formats import QuantizedWeight
from pagedllm.quant.policy import ON_THE_FLY, QuantPolicy

CHECKPOINT_BLOCKS = "mxfp4 (the checkpoint's blocks)"  # the label of an HF directory's own quantized weights


def load_weights(path: str, quantization: str | None, block_kernel: bool = False):
    """-> (arch, weights, policy or None, label for logs/metrics). ``block_kernel``: the fused CPU kernels will run
    packed blocks (``gguf`` then keeps the file's Q8_0 embedding packed too)."""
    q = None if quantization in (None, "none") else quantization
    if q is not None and q not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {quantization!r}")
    if is_quantized_checkpoint(path):
        arch_fields, weights, info = load_checkpoint(path)
        arch = ModelArchConfig(**arch_fields)
        if q is not None and q != info["method"]:
            raise ValueError(f"{path} is a {info['method']} checkpoint but --quantization {q} was given")
        return arch, weights, None, f"{info['method']} (checkpoint)"
    if q in ("rtn", "awq", "gptq"):
        raise ValueError(f"--quantization {q} loads a checkpoint made by `pagedllm quantize --method {q}`; "
                         f"{path} is not one (for load-time quantization use int8 or fp8)")
    if q == "gguf":
        if not path.endswith(".gguf"):
            raise ValueError("--quantization gguf needs a .gguf model file")
        arch, weights = (load_model_files(path, native=True) if block_kernel else load_model_files(path, native_q4=True))
        label = "gguf (native blocks, pagedllm qlinear kernel)" if block_kernel else "gguf (native 4-bit blocks)"
        return arch, weights, QuantPolicy(lm_head="int8", embed="int8"), label
    arch, weights = load_model_files(path)
    if q is None:
        blocks = any(isinstance(w, QuantizedWeight) for w in weights.values())
        return arch, weights, None, CHECKPOINT_BLOCKS if blocks else "none"
    return arch, weights, ON_THE_FLY[q], f"{q} (at load time)"
