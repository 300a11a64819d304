"""Qwen 3 (dense): llama with an RMSNorm over each q and k head (QK-norm) and no biases."""

from pagedllm.model.archs import Arch, no_sliding_window

ARCH = Arch("qwen3", ("qwen3",), lambda meta: {"qk_norm": True},
            lambda hf: no_sliding_window(hf) | {"qk_norm": True, "attention_bias": bool(hf.get("attention_bias", False))})
