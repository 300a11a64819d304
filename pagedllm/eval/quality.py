"""`pagedllm eval`: the quality gate for quantized (or any) models against a baseline.

Three measurements, all offline and deterministic:
- perplexity on held-out English text shipped with Python (``pagedllm.quant.texts``, the "eval" split);
- token-level agreement with the baseline on the same text: top-1 agreement and mean KL(baseline || candidate);
- accuracy on the business test set (``data/business.jsonl``: chat prompts with accepted answers, greedy; a base
  model without a chat template answers them as ``Question: ...`` completions).

The gate fails when perplexity rises by more than ``max_ppl_increase`` (relative) or accuracy drops by more than
``max_accuracy_drop`` (absolute fraction)."""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass

import torch

from pagedllm.model.scoring import sequence_logprobs
from pagedllm.quant.texts import python_doc_text, token_chunks
from pagedllm.sampling_params import SamplingParams

BUSINESS_SET = os.path.join(os.path.dirname(__file__), "data", "business.jsonl")


def load_items(path: str = BUSINESS_SET) -> list[dict]:
    with open(path) as f:
        items = [json.loads(line) for line in f if line.strip()]
    for it in items:
        if not it.get("prompt") or not it.get("answers"):
            raise ValueError(f"{path}: every item needs 'prompt' and 'answers': {it}")
    return items


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", " ", s.lower().replace("-", " "))).strip()


def is_correct(output: str, answers: list[str]) -> bool:
    out = f" {_norm(output)} "
    return any(f" {_norm(a)} " in out for a in answers)


def answer_items(llm, items: list[dict], max_tokens: int = 32) -> list[str]:
    """Greedy answers: as chat turns, or for a base model without a chat template as ``Question: ...\nAnswer:``
    completions (one line)."""
    if getattr(llm.get_tokenizer(), "chat_template", None):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outs = llm.chat([[{"role": "user", "content": it["prompt"]}] for it in items], params, use_tqdm=False)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=["\n"])
        outs = llm.generate([f"Question: {it['prompt']}\nAnswer:" for it in items], params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@dataclass
class ModelScores:
    label: str
    weight_bytes: int
    perplexity: float
    accuracy: float
    correct: int
    total: int
    kl: float | None = None
    top1_agreement: float | None = None
    seconds: float = 0.0


def eval_chunks(tokenizer, max_tokens: int, chunk_len: int = 256, text: str | None = None,
                as_llama_cpp: bool = False) -> list[list[int]]:
    """``chunk_len``-token windows of the held-out text (default: the Python docs' eval split). ``as_llama_cpp``:
    as ``llama-perplexity`` cuts them: the text tokenized with the model's special tokens, and each window's first
    token replaced by BOS where the model adds one."""
    text = python_doc_text("eval") if text is None else text
    chunks = token_chunks(tokenizer, text, chunk_len, max_tokens, add_special_tokens=as_llama_cpp)
    bos = tokenizer.bos_token_id
    if as_llama_cpp and bos is not None and tokenizer.encode("a", add_special_tokens=True)[0] == bos:
        return [[bos] + c[1:] for c in chunks]
    return chunks


def score_model(llm, label: str, chunks: list[list[int]], items: list[dict], baseline_logprobs=None,
                score_from: int = 0):
    """Scores of one loaded model; returns (scores, per-chunk logprobs, per-item outputs). ``score_from``: the
    predictions scored in each chunk start after this many tokens (``llama-perplexity`` scores a window's second
    half: ``chunk_len // 2``)."""
    t0 = time.perf_counter()
    model = llm.engine.runner.model
    nll, count, kl_sum, agree = 0.0, 0, 0.0, 0
    logprobs = []
    for ci, chunk in enumerate(chunks):
        lp = sequence_logprobs(model, chunk)[score_from:-1]  # position t predicts token t+1
        target = torch.tensor(chunk[score_from + 1:])
        nll -= lp.gather(1, target[:, None]).sum().item()
        count += len(target)
        if baseline_logprobs is not None:
            base = baseline_logprobs[ci]
            kl_sum += (base.exp() * (base - lp)).sum().item()
            agree += (base.argmax(-1) == lp.argmax(-1)).sum().item()
        else:
            logprobs.append(lp)
    outputs = answer_items(llm, items)
    correct = sum(is_correct(o, it["answers"]) for o, it in zip(outputs, items))
    scores = ModelScores(
        label=label, weight_bytes=model.weight_bytes(), perplexity=math.exp(nll / max(count, 1)),
        accuracy=correct / max(len(items), 1), correct=correct, total=len(items),
        kl=None if baseline_logprobs is None else kl_sum / count,
        top1_agreement=None if baseline_logprobs is None else agree / count,
        seconds=round(time.perf_counter() - t0, 1))
    return scores, logprobs, outputs


def gate(base: ModelScores, cand: ModelScores, max_ppl_increase: float, max_accuracy_drop: float) -> list[str]:
    """Reasons the candidate fails (empty when it passes)."""
    fails = []
    ppl_increase = cand.perplexity / base.perplexity - 1.0
    if ppl_increase > max_ppl_increase:
        fails.append(f"perplexity +{ppl_increase:.2%} > +{max_ppl_increase:.2%}")
    drop = base.accuracy - cand.accuracy
    if drop > max_accuracy_drop + 1e-12:
        fails.append(f"accuracy -{drop:.2%} > -{max_accuracy_drop:.2%}")
    return fails


def table(rows: list[ModelScores]) -> str:
    head = "| model | weights MiB | perplexity | mean KL vs baseline | top-1 agreement | accuracy |\n|---|---|---|---|---|---|"
    lines = [head]
    for r in rows:
        kl = "—" if r.kl is None else f"{r.kl:.4f}"
        ag = "—" if r.top1_agreement is None else f"{r.top1_agreement:.2%}"
        lines.append(f"| {r.label} | {r.weight_bytes / 2**20:.1f} | {r.perplexity:.3f} | {kl} | {ag} | "
                     f"{r.accuracy:.2%} ({r.correct}/{r.total}) |")
    return "\n".join(lines)


def to_json(rows: list[ModelScores]) -> list[dict]:
    return [asdict(r) for r in rows]
