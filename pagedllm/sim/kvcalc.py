"""KV cache size: the grouped-query-attention formula against the common one that ignores GQA.

Per token, every layer stores one key and one value vector per KV head:
``2 x layers x kv_heads x head_dim x bytes``. The formula often quoted, ``2 x layers x hidden x bytes``, counts a
KV vector per query head (multi-head attention); with GQA it overstates by ``num_heads / num_kv_heads``. A
sliding-window layer (Gemma 2 / 3, Mistral) keeps at most its window of a sequence: the per-sequence figures count
it so, as the engine's KV cache frees the blocks that fell out of the window. Gemma 4 as the engine lays it out:
the layers that read another layer's K/V keep none, and every layer's row is as wide as the widest layer's
(``ModelProfile.kv_width``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from pagedllm.sim.model_profile import ModelProfile, human_bytes

KV_DTYPE_BYTES = MappingProxyType({"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1})


def kv_dtype_bytes(kv_dtype: str) -> int:
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; known: {sorted(KV_DTYPE_BYTES)}")
    return KV_DTYPE_BYTES[kv_dtype]


def kv_bytes_per_token(m: ModelProfile, kv_dtype: str = "bf16") -> int:
    """Bytes of K and V one token holds across the layers that keep their own (grouped-query attention; the cache
    row of the widest layer, as the engine lays it out)."""
    return 2 * len(m.kv_layers()) * m.kv_width() * kv_dtype_bytes(kv_dtype)


def kv_bytes_per_sequence(m: ModelProfile, seq_len: int, kv_dtype: str = "bf16") -> int:
    """Bytes of K and V a sequence of ``seq_len`` tokens holds (sliding layers: their window; layers reading another
    layer's K/V: none)."""
    return 2 * m.kv_token_layers(seq_len) * m.kv_width() * kv_dtype_bytes(kv_dtype)


def naive_kv_bytes_per_token(m: ModelProfile, kv_dtype: str = "bf16") -> int:
    """The common formula 2 x layers x hidden x bytes (one KV vector per query head)."""
    return 2 * m.num_layers * m.hidden_size * kv_dtype_bytes(kv_dtype)


@dataclass(frozen=True)
class KVReport:
    model: str
    kv_dtype: str
    seq_len: int
    batch: int
    per_token: int
    naive_per_token: int
    per_sequence: int  # sliding layers count their window only

    @property
    def total(self) -> int:
        return self.per_sequence * self.batch

    @property
    def naive_total(self) -> int:
        return self.naive_per_token * self.seq_len * self.batch

    @property
    def overstatement(self) -> float:
        return self.naive_per_token / self.per_token

    def markdown(self) -> str:
        return "\n".join([
            f"KV cache of {self.model}, {self.kv_dtype}, batch {self.batch} x {self.seq_len} tokens:",
            "",
            "| formula | per token | per sequence | batch x sequence |",
            "|---|---|---|---|",
            f"| GQA: 2 x layers keeping K/V x kv_heads x head_dim x bytes | {human_bytes(self.per_token)} "
            f"({self.per_token:,} B) | {human_bytes(self.per_sequence)} | {human_bytes(self.total)} |",
            f"| common: 2 x layers x hidden x bytes | {human_bytes(self.naive_per_token)} "
            f"({self.naive_per_token:,} B) | {human_bytes(self.naive_per_token * self.seq_len)} "
            f"| {human_bytes(self.naive_total)} |",
            "",
            f"The common formula overstates by {self.overstatement:g}x."
            + (f" Sliding-window layers keep at most their window: a sequence holds "
               f"{self.per_sequence / (self.per_token * self.seq_len):.0%} of the all-global figure."
               if self.per_sequence < self.per_token * self.seq_len else ""),
        ])


def kv_report(m: ModelProfile, kv_dtype: str = "bf16", seq_len: int = 8192, batch: int = 1) -> KVReport:
    if seq_len < 1 or batch < 1:
        raise ValueError("seq_len and batch must be >= 1")
    return KVReport(m.name, kv_dtype, seq_len, batch, kv_bytes_per_token(m, kv_dtype),
                    naive_kv_bytes_per_token(m, kv_dtype), kv_bytes_per_sequence(m, seq_len, kv_dtype))
