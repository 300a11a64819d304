"""Linear layers as small callables: the model calls ``layer(x)`` and does not care how the weight is stored.

``DenseLinear`` holds a full-precision weight; the packed quantized kinds live in ``pagedllm.quant.linear``. Every
kind reports the bytes it keeps (``weight_bytes``) so memory can be counted without knowing the format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseLinear:
    kind = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # (N, K)
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight (for a tied embedding / LM head)."""
        return F.embedding(ids, self.weight)


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors`` (tied weights counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
