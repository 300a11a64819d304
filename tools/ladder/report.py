"""`python -m tools.ladder`'s verdicts and report, from the rows its run measured (``run.py``): each step's quality
gate, the speedups, the markdown tables and notes, the chart, and the files they are written to. Pure but for the
writing: unit-tested on hand-made rows."""

from __future__ import annotations

import os

from pagedllm.bench.common import write_json

WORKLOADS = ("w1", "prefix", "code")
TITLES = {"w1": "W1", "prefix": "shared prefix", "code": "code rewrite"}
GATE_WORKLOADS = ("prefix", "code")  # where the greedy-identity gates compare outputs


# ---------------------------------------------------------------------- gates
def greedy_identity(ref: list[str], cand: list[str]) -> dict:
    """How many of the common prompts produced the same text, and where the first differing ones diverge."""
    n = min(len(ref), len(cand))
    diffs = []
    for i in range(n):
        a, b = ref[i].rstrip("\ufffd"), cand[i].rstrip("\ufffd")  # an incomplete UTF-8 tail may be held back
        if a != b:
            pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append({"prompt": i, "char": pos})
    return {"identical": n - len(diffs), "total": n, "diffs": diffs}


def _identity_gate(row: dict, ref_row: dict | None, ref_name: str) -> dict:
    if ref_row is None or ref_row.get("error"):
        return {"status": "n/a", "detail": f"{ref_name} not measured"}
    ident = {k: greedy_identity(ref_row["texts"][k], row["texts"][k]) for k in GATE_WORKLOADS
             if k in ref_row["texts"] and k in row["texts"]}
    ident = {k: v for k, v in ident.items() if v["total"]}
    if not ident:
        return {"status": "n/a", "detail": f"no outputs to compare with {ref_name}"}
    same = sum(v["identical"] for v in ident.values())
    total = sum(v["total"] for v in ident.values())
    parts = ", ".join(f"{v['identical']}/{v['total']} {TITLES[k]}" for k, v in ident.items())
    return {"status": "PASS" if same == total else "FAILED",
            "detail": f"greedy output identical to {ref_name}: {parts}", "identity": ident}


def four_bit(runtime: dict) -> bool:
    """Whether a server's `/health` runtime says it ran 4-bit weights (the GGUF file's Q4 blocks, or a 4-bit
    checkpoint), not a float copy."""
    w = str(runtime.get("weights") or "").lower()
    return any(k in w for k in ("gguf", "awq", "gptq", "rtn", "int4", "4-bit"))


def compute_gates(rows: list[dict], eval_result: dict | None) -> None:
    """Set each row's ``gate`` ({status: PASS | FAILED | reference | n/a | not run, detail})."""
    by = {r["step"]: r for r in rows}
    for r in rows:
        failed = sum((w.get("failed") or 0) for w in r["workloads"].values())
        if r.get("error"):
            r["gate"] = {"status": "FAILED", "detail": f"error: {r['error']}"}
        elif failed:
            r["gate"] = {"status": "FAILED", "detail": f"{failed} requests failed"}
        elif r["step"] == 1:
            r["gate"] = {"status": "reference", "detail": "baseline"}
        elif r["step"] == 2:
            r["gate"] = _identity_gate(r, by.get(1), "step 1 (HF)")
        elif r["step"] == 3 and r.get("runtime") and not four_bit(r["runtime"]):
            r["gate"] = {"status": "FAILED", "detail": f"the default path did not run 4-bit weights on this CPU "
                                                       f"(weights: {r['runtime'].get('weights')!r})"}
        elif r["step"] == 3:
            info = _identity_gate(r, by.get(2), "step 2")
            note = f"; {info['detail']} (informational)" if "identity" in info else ""
            if eval_result is None:
                r["gate"] = {"status": "not run", "detail": "--skip-eval" + note}
            elif eval_result.get("error"):
                r["gate"] = {"status": "FAILED", "detail": f"eval: {eval_result['error']}" + note}
            else:
                base, cand = eval_result["scores"][0], eval_result["scores"][1]
                detail = (f"pagedllm eval vs float32: business set {cand['correct']}/{cand['total']} (float32 "
                          f"{base['correct']}/{base['total']}), perplexity {cand['perplexity']:.3f} (float32 "
                          f"{base['perplexity']:.3f}), top-1 agreement {cand['top1_agreement']:.2%}")
                if not eval_result["passed"]:
                    detail += ": " + "; ".join(eval_result.get("failures", []))
                r["gate"] = {"status": "PASS" if eval_result["passed"] else "FAILED", "detail": detail + note}
        else:
            r["gate"] = _identity_gate(r, by.get(3), "step 3")


# ---------------------------------------------------------------------- report
def speedup(rows: list[dict], step: int, workload: str) -> float | None:
    """A step's output tok/s on a workload over step 1's on the same workload (None when either is missing)."""
    by = {r["step"]: r for r in rows}
    base = by.get(1, {}).get("workloads", {}).get(workload, {}).get("output_tok_s")
    val = by.get(step, {}).get("workloads", {}).get(workload, {}).get("output_tok_s")
    return val / base if base and val else None


def _mib(b) -> str:
    return "—" if not b else f"{b / 2**20:.0f}"


def _f(v, fmt: str = ".2f") -> str:
    return "—" if v is None else format(v, fmt)


def _gate_cell(g: dict | None) -> str:
    if not g:
        return "—"
    status = {"FAILED": "**FAILED**", "PASS": "PASS"}.get(g["status"], g["status"])
    return f"{status}: {g['detail']}".replace("|", "/")


def draft_section(d: dict) -> list[str]:
    """The report's table for step 5's draft-model variant (a different target model, so its own table)."""
    if d.get("error"):
        return ["", f"Step 5, draft model: **FAILED** to run ({d['error']})."]
    base = d["rows"][0]["single_decode_tok_s"]
    lines = ["", f"Step 5 with a draft model (no draft shares SmolLM2-135M's tokenizer, so on another target): "
             f"`{d['target']}` with draft `{d['draft']}`, one code-rewrite request at a time, greedy, up to "
             f"{d['output_len']} tokens (`{d['command']}`). Gate: {_gate_cell(d['gate'])}.", "",
             "| speculation | decode tok/s | × none | mean acceptance length | greedy identical |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['config']} | {r['single_decode_tok_s']:.1f} | {r['single_decode_tok_s'] / base:.2f}x | "
                     f"{r.get('mean_acceptance_length', 1.0):.2f} | {r['greedy_identical']} |")
    return lines


def build_report(rows: list[dict], meta: dict) -> str:
    """The markdown report: header, the ladder table (each step on its target workload), every step on every
    workload, and notes. Pure: unit-tested on hand-made rows."""
    rows = sorted(rows, key=lambda r: r["step"])
    L, C = meta["output_len"], meta["concurrency"]
    lines = [f"Command: `{meta['command']}`", ""]
    if meta.get("cpu"):
        lines.append(f"CPU: {meta['cpu']}, {meta.get('cpus', '?')} logical CPUs; {meta.get('date', '')}.")
    wl = meta.get("workloads", {})
    desc = []
    for k in WORKLOADS:
        info = wl.get(k)
        if info:
            desc.append(f"{TITLES[k]}: {info['num_prompts']} prompts of {info['prompt_tokens_min']}-"
                        f"{info['prompt_tokens_max']} tokens ({info['description']})")
    if desc:
        lines.append("Workloads — " + "; ".join(desc) + ".")
    lines.append(f"Each prompt: {L} greedy output tokens (EOS ignored and masked). Server steps: streaming "
                 f"`/v1/completions` at concurrency {C}; step 1: the same burst served one request at a time "
                 f"(latency counts the wait).")
    lines += ["", "| step | what changes | flags | measured on | output tok/s | × step 1 | mean latency (s) | "
              "p99 latency (s) | mean TTFT (s) | weights + peak KV (MiB) | peak RSS (MiB) | quality gate |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w = r["workloads"].get(r["target"], {})
        failed = (r.get("gate") or {}).get("status") == "FAILED"
        title = r["title"] + (" (**FAILED**)" if failed else "")
        sp = speedup(rows, r["step"], r["target"])
        mem = "—"
        if r.get("weights_bytes"):
            kv = w.get("kv_bytes_used_peak") or 0
            mem = f"{_mib(r['weights_bytes'])} + {kv / 2**20:.0f} = {(r['weights_bytes'] + kv) / 2**20:.0f}"
        flags = r["flags"].replace("|", "/")
        ref_subset = any(x["step"] == 1 and x["workloads"].get(r["target"], {}).get("subset") for x in rows)
        sp_cell = "—" if sp is None else f"{sp:.2f}x" + ("†" if ref_subset else "")
        lines.append(
            f"| {r['step']} | {title} | `{flags}` | {TITLES[r['target']]} | {_f(w.get('output_tok_s'), '.1f')} | "
            f"{sp_cell} | {_f(w.get('mean_latency_s'))} | {_f(w.get('p99_latency_s'))} | "
            f"{_f(w.get('mean_ttft_s'))} | {mem} | {_mib(r.get('peak_rss_bytes'))} | {_gate_cell(r.get('gate'))} |")
    lines += ["", "Every step on every workload: output tok/s (× step 1 on the same workload); the step's target "
              "workload in bold.", "",
              f"| step | {' | '.join(TITLES[k] for k in WORKLOADS)} | code rewrite, one stream |",
              "|---|" + "---|" * (len(WORKLOADS) + 1)]
    for r in rows:
        cells = []
        for k in WORKLOADS:
            w = r["workloads"].get(k)
            if not w or w.get("output_tok_s") is None:
                cells.append("—")
                continue
            sp = speedup(rows, r["step"], k)
            c = f"{w['output_tok_s']:.1f}" + ("" if sp is None else f" ({sp:.2f}x)")
            c += "†" if w.get("subset") else ""
            cells.append(f"**{c}**" if k == r["target"] else c)
        if r["step"] == 1:
            code = r["workloads"].get("code")
            one = "same as code rewrite (one at a time)" if code else "—"
        else:
            ss = r.get("single_stream")
            one = "—" if not ss else f"{ss['output_tok_s']:.1f}"
        lines.append(f"| {r['step']} | " + " | ".join(cells) + f" | {one} |")
    n_gate = meta.get("gate_prompts")
    on = f"the first {n_gate} prompts" if n_gate else "the first prompts"
    notes = [f"Gates: step 2, greedy output identical to step 1 on {on} of the shared-prefix and code-rewrite "
             f"sets; step 3, `pagedllm eval` of the default weights against float32 (its thresholds, by default "
             f"perplexity +5% and business-set accuracy -1 point); steps 4 and 5, greedy output identical to step 3 "
             f"on the same prompts. A FAILED step keeps its numbers."]
    hf = next((r for r in rows if r["step"] == 1), None)
    if hf and any(w.get("subset") for w in hf["workloads"].values()):
        n = max(w.get("num_prompts", 0) for w in hf["workloads"].values() if w.get("subset"))
        notes.append(f"† step 1 on the first {n} prompts of that workload (one-at-a-time throughput does not depend "
                     f"on the queue length).")
    for r in rows:
        for k, w in r["workloads"].items():
            if "prefix_cache_hit_rate" in w and w["prefix_cache_hit_rate"] > 0.01:
                notes.append(f"Step {r['step']}, {TITLES[k]}: prefix-cache hit rate "
                             f"{w['prefix_cache_hit_rate']:.0%} of prompt tokens.")
            if "spec_mean_acceptance_length" in w:
                notes.append(f"Step {r['step']}, {TITLES[k]}: mean acceptance length "
                             f"{w['spec_mean_acceptance_length']:.2f} tokens per step, acceptance rate "
                             f"{w['spec_acceptance_rate']:.0%}.")
    ran: dict[str, list[str]] = {}  # what the server reported running (/health), steps with the same grouped
    for r in rows:
        if r.get("runtime"):
            rt = r["runtime"]
            plan = (rt.get("weight_plan") or {}).get("description")
            what = (f"dtype {rt.get('dtype')}, weights {rt.get('weights')}, kernels {rt.get('kernels')}"
                    + (f" ({plan})" if plan else ""))
            ran.setdefault(what, []).append(str(r["step"]))
    for what, steps in ran.items():
        notes.append(f"Step{'s' if len(steps) > 1 else ''} {', '.join(steps)} ran: {what}.")
    for r in rows:
        w = r["workloads"].get(r["target"], {})
        if w.get("kv_bytes_static_max_len"):
            notes.append(f"Step {r['step']}: peak KV in use {w['kv_bytes_used_peak'] / 2**20:.0f} MiB vs "
                         f"{w['kv_bytes_static_max_len'] / 2**20:.0f} MiB for a static max-length reservation.")
            break
    notes += meta.get("notes", [])
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    if meta.get("draft_step"):
        lines += draft_section(meta["draft_step"])
    return "\n".join(lines) + "\n"


def write_chart(rows: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = sorted(rows, key=lambda r: r["step"])
    names = [f"{r['step']}. {r['title']}" for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 0.6 * len(rows) + 2.5))
    y = np.arange(len(rows))
    h = 0.8 / len(WORKLOADS)
    for i, k in enumerate(WORKLOADS):
        vals = [r["workloads"].get(k, {}).get("output_tok_s") or 0 for r in rows]
        a1.barh(y + (i - 1) * h, vals, height=h, label=TITLES[k])
    a1.set_yticks(y, names)
    a1.set_xlabel("output tokens/s (higher is better)")
    a1.legend(loc="best", fontsize=8)
    sps = [speedup(rows, r["step"], r["target"]) or 0 for r in rows]
    failed = [(r.get("gate") or {}).get("status") == "FAILED" for r in rows]
    a2.barh(y, sps, color=["tab:red" if f else "tab:green" for f in failed])
    for yi, (s, f, r) in enumerate(zip(sps, failed, rows)):
        a2.text(s, yi, f" {s:.2f}x on {TITLES[r['target']]}" + (" FAILED gate" if f else ""), va="center",
                fontsize=8)
    a2.set_yticks(y, [])
    a2.set_xlim(0, max(sps + [1.0]) * 1.45)  # room for the labels
    a2.set_xlabel("speedup over step 1 on the step's target workload")
    for ax in (a1, a2):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"python -m tools.ladder: {meta['num_prompts']} prompts x {meta['output_len']} tokens, "
                 f"concurrency {meta['concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(rows: list[dict], meta: dict, results_dir: str, result_json: str | None = None) -> str:
    report = build_report(rows, meta)
    doc = {"meta": meta, "rows": rows}
    for path in [os.path.join(results_dir, "results.json")] + ([result_json] if result_json else []):
        write_json(path, doc)
    with open(os.path.join(results_dir, "results.md"), "w") as f:
        f.write(report)
    write_chart(rows, meta, os.path.join(results_dir, "chart.png"))
    return report
