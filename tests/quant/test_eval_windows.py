"""`pagedllm eval --as-llama-perplexity`: windows cut as llama-perplexity cuts them (BOS first where the model adds
one) and each window's second half scored; such a run records no verdict for auto."""

import json

from pagedllm.eval.quality import eval_chunks


class FakeTokenizer:
    bos_token_id = 1

    def __init__(self, adds_bos: bool):
        self.adds_bos = adds_bos

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [10 + ord(c) % 50 for c in text]
        return ([self.bos_token_id] if add_special_tokens and self.adds_bos else []) + ids


def test_windows_as_llama_perplexity():
    text = "abcdefghij" * 10
    plain = eval_chunks(FakeTokenizer(True), 64, 16, text)
    assert len(plain) == 4 and plain[0][0] != 1  # no special tokens, as before
    as_llama = eval_chunks(FakeTokenizer(True), 64, 16, text, as_llama_cpp=True)
    ids = FakeTokenizer(True).encode(text, add_special_tokens=True)
    assert as_llama == [[1] + ids[i + 1:i + 16] for i in range(0, 64, 16)]  # every window starts with BOS
    assert eval_chunks(FakeTokenizer(False), 64, 16, text, as_llama_cpp=True) == plain  # a model without BOS


def test_eval_cli_as_llama_perplexity(tmp_path, monkeypatch, capsys):
    from pagedllm.cli.main import main

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "scores.json"
    assert main(["eval", "--candidate", "default", "--candidate-dtype", "auto", "--candidate-activation-bits", "8",
                 "--items", "none", "--text", str(text), "--chunk-len", "256", "--as-llama-perplexity",
                 "--eval-tokens", "512", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(0 items, 512 text tokens)" in printed
    assert "(a non-standard gate: auto does not use it)" in printed  # recorded, but not trusted by auto
    base, cand = json.loads(out.read_text())["scores"]
    assert base["kl"] is None and 0 < cand["kl"] < 0.1 and 0.8 < cand["top1_agreement"] <= 1
