"""Text that ships with Python itself, for calibration and perplexity: the language reference topics in
``pydoc_data.topics`` (~470 kB of English prose). Topics are split by position: even-numbered ones (sorted by
name) calibrate, odd-numbered ones are held out for evaluation, so a quantizer never sees the evaluation text."""

from __future__ import annotations

import json


def python_doc_text(split: str) -> str:
    from pydoc_data.topics import topics

    if split not in ("calib", "eval"):
        raise ValueError("split must be 'calib' or 'eval'")
    keys = sorted(topics)
    keep = keys[0::2] if split == "calib" else keys[1::2]
    return "\n\n".join(topics[k] for k in keep)


def token_chunks(tokenizer, text: str, chunk_len: int, max_tokens: int,
                 add_special_tokens: bool = False) -> list[list[int]]:
    """Consecutive ``chunk_len``-token windows of ``text``, at most ``max_tokens`` tokens in all."""
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)[:max_tokens]
    return [ids[i:i + chunk_len] for i in range(0, len(ids) - chunk_len + 1, chunk_len)]


def read_text_file(path: str) -> str:
    """A plain text file, or JSONL whose records have a ``text`` or ``prompt`` field."""
    with open(path) as f:
        data = f.read()
    if path.endswith(".jsonl"):
        out = []
        for line in data.splitlines():
            if line.strip():
                rec = json.loads(line)
                out.append(rec.get("text") or rec.get("prompt") or "")
        return "\n\n".join(out)
    return data
