"""``model.gguf_file.GGUFFile`` (the engine's GGUF header reader) against gguf's own ``GGUFReader``, and the loader's
torch de-quantization of Q4_0/Q4_1/Q8_0 blocks against gguf's numpy one: the same values, bit for bit."""

import gguf
import numpy as np
import pytest

from pagedllm.config import default_model_path
from pagedllm.gguf_file import GGUFFile
from pagedllm.model.loader import _dequantize, open_gguf


def _assert_same_as_gguf(path):
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    ref_fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == ref_fields
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(x) for x in b.shape), a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (int(b.n_elements), int(b.n_bytes), int(b.data_offset))
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
    return ours


def _bitwise_equal(x: np.ndarray, y: np.ndarray) -> bool:
    return x.shape == y.shape and x.dtype == y.dtype == np.float32 and np.array_equal(x.view(np.uint32),
                                                                                     y.view(np.uint32))


def test_default_model_header_tensors_and_values_equal_ggufs():
    f = _assert_same_as_gguf(default_model_path())
    assert len(f.fields["tokenizer.ggml.tokens"]) == 49152 and f.fields["general.architecture"] == "llama"
    kinds = set()
    for t in f.tensors:
        kinds.add(t.tensor_type.name)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        assert _bitwise_equal(_dequantize(t.data, t.tensor_type), ref), t.name
    assert {"Q4_1", "Q8_0", "F32"} <= kinds


@pytest.fixture
def every_kind_file(tmp_path):
    """A GGUF file written by gguf's writer with a field of every value type and tensors of every type the loader
    decodes itself (Q4_0, Q4_1, Q8_0) or hands to gguf (F32, F16)."""
    rng = np.random.default_rng(0)
    path = str(tmp_path / "kinds.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.125)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ü", "<|im_end|>"])
    x = rng.standard_normal((8, 64)).astype(np.float32)
    for kind in ("Q4_0", "Q4_1", "Q8_0"):
        qt = gguf.GGMLQuantizationType[kind]
        w.add_tensor(f"w.{kind}", gguf.quants.quantize(x * 3, qt), raw_dtype=qt)
    w.add_tensor("w.F32", x)
    w.add_tensor("w.F16", x.astype(np.float16))
    w.add_tensor("w.vec", x[0].copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_and_tensor_type_equals_ggufs(every_kind_file):
    f = _assert_same_as_gguf(every_kind_file)
    assert f.fields["t.str"] == "héllo ✓" and f.fields["t.strs"] == ["a", "", "ü", "<|im_end|>"]
    assert f.fields["t.u64"] == 2**63 + 5 and f.fields["t.bool"] is True
    for t in f.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        assert _bitwise_equal(_dequantize(t.data, t.tensor_type), ref), t.name


@pytest.mark.parametrize("cut", [3, 9, 40, 300])
def test_cut_header_is_a_clear_error(every_kind_file, tmp_path, cut):
    data = open(every_kind_file, "rb").read()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        open_gguf(str(bad))


def test_wrong_magic_version_and_empty_file(every_kind_file, tmp_path):
    data = bytearray(open(every_kind_file, "rb").read())
    cases = {"magic": b"GGUX" + data[4:], "version": data[:4] + (7).to_bytes(4, "little") + data[8:],
             "big-endian": data[:4] + (3).to_bytes(4, "big") + data[8:], "empty": b""}
    for name, blob in cases.items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(bytes(blob))
        with pytest.raises(ValueError, match="not a readable GGUF file"):
            open_gguf(str(p))
    with pytest.raises(ValueError, match="magic"):
        GGUFFile(str(tmp_path / "magic.gguf"))
    with pytest.raises(ValueError, match="big-endian"):
        GGUFFile(str(tmp_path / "big-endian.gguf"))


def test_hand_made_header_nested_arrays_and_duplicates(tmp_path):
    """A header written by hand: nested arrays come back nested; a repeated key or a non-integer alignment is an
    error naming what is wrong."""
    import struct

    def s(text):
        b = text.encode()
        return struct.pack("<Q", len(b)) + b

    def header(fields):
        return b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields)) + b"".join(fields)

    nested = s("t.nested") + struct.pack("<IIQ", 9, 9, 2) + struct.pack("<IQ", 4, 2) + struct.pack("<II", 1, 2) \
        + struct.pack("<IQ", 8, 1) + s("x")
    p = tmp_path / "nested.gguf"
    p.write_bytes(header([nested]))
    assert GGUFFile(str(p)).fields["t.nested"] == [[1, 2], ["x"]]
    one = s("a") + struct.pack("<II", 4, 1)
    p.write_bytes(header([one, one]))
    with pytest.raises(ValueError, match="duplicated field 'a'"):
        GGUFFile(str(p))
    p.write_bytes(header([s("general.alignment") + struct.pack("<I?", 7, True)]))
    with pytest.raises(ValueError, match="alignment"):
        GGUFFile(str(p))
