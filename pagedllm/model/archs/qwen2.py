"""Qwen 2 / 2.5 (Qwen2.5-Coder): llama with biases on q, k and v."""

from pagedllm.model.archs import Arch

ARCH = Arch("qwen2", ("qwen2",), lambda meta: {"attention_bias": True}, lambda hf: {"attention_bias": True})
