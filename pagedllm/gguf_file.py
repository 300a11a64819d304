"""A GGUF file's header (metadata fields and tensor table) read in one pass with ``struct``, and its tensors as numpy
views of one read-only memory map.

``gguf.GGUFReader`` builds a numpy view for every element of every array field. The default model's vocabulary
(49,152 tokens and 48,900 merges) makes that ~2.7 s of every engine start, and a test run starts ~80 engines and
servers. This reader decodes the same header in about 0.1 s. The ``gguf`` package still supplies the type tables
(``GGMLQuantizationType``, ``GGML_QUANT_SIZES``) and the de-quantization. The fields' values and the tensors' types,
shapes, offsets and data equal ``GGUFReader``'s (``tests/test_gguf_file.py``), except that an array of arrays comes
back nested (GGUFReader flattens it) and a duplicated field is an error.

Format (little-endian, versions 2 and 3): magic ``GGUF``, version u32, tensor count u64, field count u64; each field
a string key, a u32 value type and the value (strings: u64 length + UTF-8; arrays: u32 element type, u64 count,
elements); each tensor a string name, u32 number of dims, u64 dims (innermost first), u32 ggml type, u64 offset
from the start of the data section, which begins at the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# gguf's GGUFValueType numbering -> numpy dtype of a number of that type (8: string, 9: array)
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")

# ggml types whose tensors are typed numpy arrays (the rest are blocks: uint8 rows of bytes), as GGUFReader gives them
_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type as pagedllm runs it: the one table of its facts, which the loader, the block decoders
    (``quant.gguf_blocks``), the C++ packer (``kernel_type``, passed with every call) and the simulator read."""

    name: str
    values: int  # weights per block
    nbytes: int  # bytes per block
    code_bits: int  # the block kernels' code width: 4 (unsigned nibbles) or 8 (signed bytes)
    group: int  # weights per scale (32; 16 where a K-quant's sub-blocks are 16 weights)
    k_scaled: bool = False  # two-level scales kept as the file has them (``QuantizedWeight.kscales``)
    decoder: int = 0  # > 0: the C++ one-pass decoder (kernels/csrc/pack.cpp ``decode_blocks``) of its codes
    head: int = 0  # > 0: bytes before a 32-block's codes (f16 d, and m): the loader decodes it to floats itself
    narrow: int = 8  # its 8-bit codes fit 5 bits ([-16, 16)) or 6 ([-32, 32)): the block kernels pack them so

    def kernel_type(self) -> tuple[int, int, int, int]:
        """What the C++ packer receives: (decoder, values, bytes, code bits)."""
        return self.decoder, self.values, self.nbytes, self.code_bits


BLOCK_TYPES = {t.name: t for t in (
    BlockType("Q4_0", 32, 18, 4, 32, decoder=1, head=2),
    BlockType("Q4_1", 32, 20, 4, 32, decoder=2, head=4),
    BlockType("Q5_0", 32, 22, 8, 32, decoder=6, narrow=5),
    BlockType("Q5_1", 32, 24, 8, 32),
    BlockType("Q8_0", 32, 34, 8, 32, decoder=7, head=2),
    BlockType("Q2_K", 256, 84, 4, 16, k_scaled=True),
    BlockType("Q3_K", 256, 110, 4, 16, k_scaled=True),
    BlockType("Q4_K", 256, 144, 4, 32, k_scaled=True, decoder=3),
    BlockType("Q5_K", 256, 176, 8, 32, k_scaled=True, decoder=4, narrow=6),
    BlockType("Q6_K", 256, 210, 8, 16, k_scaled=True, decoder=5, narrow=6),
    BlockType("IQ4_NL", 32, 18, 8, 32),
    BlockType("IQ4_XS", 256, 136, 8, 32, k_scaled=True),
    BlockType("MXFP4", 32, 17, 4, 32),  # 4-bit codes through a table of its 16 values (``quant.gguf_blocks.mxfp4``)
)}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost (row length) first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # a read-only view: typed (numpy order, outermost first) or, for blocks, uint8 (rows, bytes)


class GGUFFile:
    """``fields``: key -> value (int, float, bool, str, or a list of them for arrays); ``tensors``: in file order.
    Raises ValueError on a file that is not a whole little-endian GGUF v2/v3 file."""

    def __init__(self, path: str) -> None:
        import gguf
        from gguf.constants import GGML_QUANT_SIZES
        from gguf.quants import quant_shape_to_byte_shape

        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise ValueError("empty file") from None
        self._buf = memoryview(self._map)
        self._pos = 0
        try:
            if bytes(self._buf[:4]) != GGUF_MAGIC:
                raise ValueError("GGUF magic invalid")
            self._pos = 4
            self.version = self._unpack("<I")
            if self.version & 0xFFFF == 0:
                raise ValueError("a big-endian GGUF file (not supported)")
            if self.version not in (2, 3):
                raise ValueError(f"GGUF version {self.version} (supported: 2, 3)")
            n_tensors, n_fields = self._unpack("<Q"), self._unpack("<Q")
            self.fields: dict = {}
            for _ in range(n_fields):
                key = self._string()
                if key in self.fields:
                    raise ValueError(f"duplicated field {key!r}")
                self.fields[key] = self._value(self._unpack("<I"))
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
                infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        except struct.error:
            raise ValueError(f"the header ends early (at byte {self._pos} of {len(self._buf)})") from None
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment!r}")
        self.data_offset = -(-self._pos // alignment) * alignment
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        seen = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name!r}")
            seen.add(name)
            ttype = gguf.GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[ttype]
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            n_bytes = n_elems * type_size // block
            start = self.data_offset + offset
            np_dims = tuple(reversed(dims))
            if start + n_bytes > len(whole):
                data = whole[0:0]  # past the end: open_gguf names the truncation
            elif ttype.name in _TYPED:
                data = whole[start:start + n_bytes].view(_TYPED[ttype.name]).reshape(np_dims)
            else:
                data = whole[start:start + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, ttype))
            self.tensors.append(GGUFTensor(name, ttype, dims, n_elems, n_bytes, start, data))
        del self._buf  # the tensors' arrays keep the map alive

    def release(self, t: "GGUFTensor", lo: int = 0, hi: int | None = None) -> None:
        """Drop tensor ``t``'s pages of the memory map from this process's resident set (they stay in the page
        cache): a tensor decoded into the engine's own layout is not read again, and its mapped pages would
        otherwise count a second time against the process's memory until the map is closed. ``lo``, ``hi``: only
        the pages of its bytes [lo, hi) (a part decoded so far; a page it shares with a neighbour is dropped too,
        and read back from the page cache if that is touched again)."""
        page = mmap.PAGESIZE
        hi = int(t.n_bytes) if hi is None else min(int(hi), int(t.n_bytes))
        start = (int(t.data_offset) + int(lo)) // page * page
        end = int(t.data_offset) + hi
        if end <= start:
            return
        if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            try:
                self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
            except OSError:
                pass

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    # ------------------------------------------------------------------ header decoding
    def _unpack(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._unpack("<Q")
        end = self._pos + n
        if end > len(self._buf):
            raise struct.error("string past the end")
        s = str(self._buf[self._pos:end], "utf-8")
        self._pos = end
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<I"), self._unpack("<Q")
            if etype in _NUMPY:  # a numeric array in one read
                return self._numbers(etype, count)
            if etype == _STRING:  # a vocabulary: 150k strings in a loop of local names (4x fewer lookups)
                return self._strings(count)
            return [self._value(etype) for _ in range(count)]
        if vtype not in _NUMPY:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self._pos}")
        return self._numbers(vtype, 1)[0]

    def _strings(self, count: int) -> list[str]:
        buf, pos, size, length = self._buf, self._pos, len(self._buf), _U64.unpack_from
        out = []
        for _ in range(count):
            (n,) = length(buf, pos)
            end = pos + 8 + n
            if end > size:
                raise struct.error("string past the end")
            out.append(str(buf[pos + 8:end], "utf-8"))
            pos = end
        self._pos = pos
        return out

    def _numbers(self, vtype: int, count: int) -> list:
        dt = np.dtype(_NUMPY[vtype])
        end = self._pos + count * dt.itemsize
        if end > len(self._buf):
            raise struct.error("value past the end")
        vals = np.frombuffer(self._buf, dtype=dt, count=count, offset=self._pos).tolist()
        self._pos = end
        return vals
