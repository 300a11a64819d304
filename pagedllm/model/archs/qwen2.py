"""Qwen 2 / 2.5 (Qwen2.5-Coder): llama with biases on q, k and v."""

from pagedllm.model.archs import Arch, no_sliding_window

ARCH = Arch("qwen2", ("qwen2",), lambda meta: {"attention_bias": True},
            lambda hf: no_sliding_window(hf) | {"attention_bias": True})
