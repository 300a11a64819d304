"""The quality verdicts that `--activation-bits auto` and `--large-step-weights auto` read (``quant.verdicts``):
the user's recorded verdict, then the shipped table, then the default; keyed by the file's contents."""

import hashlib
import os
import shutil
import types

from pagedllm.quant import verdicts


def test_verdicts_follow_the_contents_and_their_order(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "a.gguf"
    f.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    path = str(f)
    decide = lambda bits, large, what="x": verdicts.decide(  # noqa: E731
        path, bits, large, what, verdicts.BF16_DEFAULT if large == "bf16" else verdicts.default_for_blocks(True))
    # a file in neither the user's verdicts nor the table: the default given (8 bits on K-quants, not elsewhere)
    v = decide(8, "blocks")
    assert v == (True, "default", v.why) and "llama.cpp" in v.why
    assert verdicts.decide(path, 8, "blocks", "x", verdicts.default_for_blocks(False)).passed is False
    assert decide(8, "bf16").passed is True
    # the shipped table, found by the file's sha256 (and only for a file of a shipped size)
    digest = verdicts.file_sha256(path)
    entry = verdicts.Shipped("a", os.path.getsize(path) + 1, {"8": (False, "lost 3 items"), "8:bf16": (True, "kept")})
    monkeypatch.setitem(verdicts.SHIPPED, digest, entry)
    assert decide(8, "blocks").passed is True  # its size is not the entry's: not looked up
    monkeypatch.setitem(verdicts.SHIPPED, digest, entry._replace(size=os.path.getsize(path)))
    v = decide(8, "blocks")
    assert v.passed is False and v.source == "shipped" and "lost 3 items" in v.why
    assert decide(8, "bf16") == (True, "shipped", decide(8, "bf16").why)
    assert decide(16, "bf16").source == "default"  # no such entry
    # a verdict recorded here decides either way; a non-standard one is not trusted
    verdicts.record(path, 8, "blocks", True, "measured here", standard=False)
    assert decide(8, "blocks").source == "shipped"
    verdicts.record(path, 8, "blocks", True, "measured here", standard=True)
    assert decide(8, "blocks")[:2] == (True, "recorded")
    verdicts.record(path, 8, "bf16", False, "measured here", standard=True)
    assert decide(8, "bf16")[:2] == (False, "recorded")
    # keyed by contents: a copy elsewhere (another path and time) has the same verdicts, an edited file none
    copy = tmp_path / "elsewhere" / "b.gguf"
    copy.parent.mkdir()
    shutil.copyfile(path, copy)
    assert verdicts.recorded(str(copy), 8)["passed"] is True
    f.write_bytes(f.read_bytes() + b"\0")
    assert verdicts.recorded(path, 8) is None and decide(8, "blocks").source == "default"
    assert verdicts.file_sha256(path) != digest  # the digest cache follows the file's size and time
    # hashed on a thread while the weights load: the lookup waits for it, and nothing is hashed twice
    f.write_bytes(f.read_bytes() + b"\1")
    calls = []
    monkeypatch.setattr(verdicts, "hashlib", types.SimpleNamespace(sha256=lambda: calls.append(1) or hashlib.sha256()))
    verdicts.start_sha256(path)
    verdicts.start_sha256(path)  # already under way: not started again
    assert verdicts.file_sha256(path) == hashlib.sha256(f.read_bytes()).hexdigest() and calls == [1]
    key = verdicts.file_cache_key(path)
    assert key not in verdicts._pending  # joined: the thread forgot itself as it ended
    verdicts.start_sha256(path)  # known now: no thread
    assert key not in verdicts._pending and calls == [1]


def test_a_serve_command_starts_hashing_its_file_before_the_engine_imports(tmp_path, monkeypatch):
    """`pagedllm serve --model F.gguf` (and generate, chat, the api_server module) starts the verdicts' hash before
    the parser imports torch: in the CLI's first lines, for a GGUF file whose numerics are left to the verdicts."""
    import subprocess
    import sys

    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(200))
    started = []
    monkeypatch.setattr(verdicts, "start_sha256", started.append)
    (tmp_path / "d.gguf").mkdir()
    for argv in (["--model", str(f)], [f"--model={f}", "--port", "1"], ["--model", str(f), "--activation-bits", "8"],
                 ["--model", "x.gguf", "--model", str(f)],  # argparse keeps the last
                 ["--activation-bits=16", "--large-step-weights", "blocks", "--model", str(f)],
                 ["--model", str(f), "--data-parallel-size", "2"],  # the replicas hash it, not the balancer
                 ["--model", str(tmp_path / "missing.gguf")], ["--model", str(tmp_path / "d.gguf")], ["--port", "1"]):
        verdicts.start_sha256_for_command(argv)
    assert started == [str(f)] * 4  # not where both paths are pinned, nor for a missing file or a directory
    # the CLI: the hash is under way (or done) before torch is imported, and a bad flag still fails as before
    code = ("import sys; from pagedllm.cli.main import main; from pagedllm.quant import verdicts; "
            "verdicts.start_sha256 = lambda p: print('hash', p, 'torch' in sys.modules) or sys.exit(0); "
            f"main(['serve', '--model', {str(f)!r}])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["hash", str(f), "False"], run.stdout + run.stderr


def test_the_shipped_table_covers_the_fetched_and_embedded_files():
    """Every file `pagedllm fetch` pins (and the embedded default) has its shipped verdicts: a new pin needs its
    gate measured and entered, or a user of it would get the default instead of what was measured."""
    from pagedllm.config import default_model_path
    from pagedllm.model.fetch import MODELS

    assert {m.sha256 for m in MODELS.values()} <= set(verdicts.SHIPPED)
    path = default_model_path()
    entry = verdicts.SHIPPED[verdicts.file_sha256(path)]
    assert entry.size == os.path.getsize(path) and set(entry.verdicts) == {"8", "16:bf16"}
