"""`python -m tools.reliability`: bad input, disconnects, overload, faults and shutdown, at volume.

The command launches the servers it needs (a phase that kills or restarts one gets its own, see ``phases.py``),
prints each phase's line as it ends and writes the results as a markdown table (docs/reliability.md holds one) and
JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from pagedllm.bench.common import add_dtype_arg, add_result_json_arg, write_json
from pagedllm.bench.compare import running_server
from pagedllm.bench.cpuinfo import cpu_line
from tools.reliability.phases import (phase_auth, phase_corrupt_models, phase_disconnects,
                                      phase_forward_fault, phase_fuzz, phase_overload, phase_server_log,
                                      phase_shutdown, phase_soak, phase_tp_kill)
from tools.reliability.probes import FAIL_TOKEN
from pagedllm.config import default_model_path


# ---------------------------------------------------------------------- report
def write_report(results: list[dict], meta: dict) -> str:
    lines = [f"# pagedllm reliability run ({meta['date']})", "",
             f"CPU: {meta['cpu']}. Command: `{meta['command']}`", "",
             "| phase | requests / events | figures | result |", "|---|---|---|---|"]
    for r in results:
        volume, figures = _summary(r)
        lines.append(f"| {r['phase']} | {volume} | {figures} | {'pass' if r['passed'] else 'FAIL'} |")
    for r in results:
        if r["problems"]:
            lines += ["", f"## {r['phase']}: problems", *[f"- {p}" for p in r["problems"]]]
    return "\n".join(lines) + "\n"


def _summary(r: dict) -> tuple[str, str]:
    """A phase result's (volume, figures) for the table and the progress line."""
    p, kv = r["phase"], r.get("kv", {})
    if p == "fuzz":
        t = r["total"]
        return (f"{r['requests']} (schemathesis {r['schemathesis']['sent']}, hypothesis bodies "
                f"{r['bodies']['sent']}, hostile {r['hostile']['sent']})",
                f"4xx {t['4xx']} (OpenAI shape {t['4xx_openai_shape']}), 5xx {t['5xx']}, no response "
                f"{t['no_response']}, schema check failures {sum(r['schemathesis']['check_failures'].values())}, "
                f"greedy unchanged {r['greedy_unchanged']}, leaked blocks {kv['leaked_blocks']}")
    if p == "disconnects":
        return (str(r["requests"]),
                f"outcomes {r['outcomes']}, leaked blocks {kv['leaked_blocks']}, settled in {kv['settle_s']} s")
    if p == "soak":
        return (str(r["requests"]),
                f"{r['duration_s']:.0f} s, RSS {r['rss_first_mib']} → {r['rss_last_mib']} MiB "
                f"({r['rss_growth']:+.1%}), leaked blocks {kv['leaked_blocks']}, "
                f"greedy unchanged {r['greedy_unchanged']}")
    if p == "overload":
        return (f"burst {r['burst']}",
                f"statuses {r['statuses']}, hung {r['hung']}, admitted {r['admitted_tok_s']} tok/s vs unloaded "
                f"{r['unloaded_tok_s']} ({r['ratio']:.0%}), leaked blocks {kv['leaked_blocks']}")
    if p == "auth":
        return (f"{r['requests']} on {r['routes']} routes",
                f"public: {', '.join(r['public'])}; everything else 401 without the right key")
    if p == "forward fault":
        return (f"{r['faults_injected']} faults among {r['good_requests']} good",
                f"good outputs identical {r['good_identical']}, leaked blocks {kv['leaked_blocks']}")
    if p == "server log":
        return f"{r['lines']} lines", ", ".join(f"{m!r}: {n}" for m, n in r["counts"].items())
    if p == "shutdown":
        return (f"{r['in_flight']} in flight",
                f"outcomes {sorted(set(r['outcomes']))}, exit {r['exit_code']} after {r['exit_s']} s "
                f"(drain {r['drain_s']} s)")
    if p == "corrupt model files":
        return (f"{len(r['files'])} files",
                "; ".join(f"{k}: exit {v['exit_code']}" for k, v in r["files"].items()))
    return (str(r["workers_killed"]),  # tensor-parallel rank killed
            f"exit {r['exit_code']} after {r['exit_s']} s, stream error event {r['stream_got_error_event']}")


# ---------------------------------------------------------------------- command
PHASES = ("fuzz", "disconnects", "soak", "overload", "auth", "fault", "shutdown", "corrupt", "tp")


def main(args: argparse.Namespace) -> int:
    phases = args.phases.split(",") if args.phases else list(PHASES)
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise ValueError(f"unknown phases {sorted(unknown)}; choose from {PHASES}")
    workdir = args.results_dir or tempfile.mkdtemp(prefix="pagedllm-reliability-")
    os.makedirs(workdir, exist_ok=True)
    extra = args.server_args.split()
    results: list[dict] = []

    def report(r: dict) -> None:
        results.append(r)
        print(f"[{r['phase']}] {'pass' if r['passed'] else 'FAIL'}: {_summary(r)[1]}", flush=True)
        for p in r["problems"][:5]:
            print(f"    {p}", flush=True)

    def shared_phases(base: str, key: str | None) -> None:
        if "auth" in phases:
            if key:
                report(phase_auth(base, key))
            else:
                print("[auth] skipped: the server at --url has no --api-key given here")
        if "fuzz" in phases:
            report(phase_fuzz(base, key, args.schema_examples, args.body_examples, args.seed))
        if "disconnects" in phases:
            report(phase_disconnects(base, key, args.disconnects, args.concurrency, args.seed))
        if "fault" in phases:
            if args.url and args.fault_token is None:
                print("[forward fault] skipped: give --fault-token T for a server started with --fault-injection "
                      "'{\"forward_fail_token\": T}'")
            else:
                report(phase_forward_fault(base, key, args.fault_token or FAIL_TOKEN))
        if "overload" in phases:
            report(phase_overload(base, key, args.max_num_seqs, args.burst))
        if "soak" in phases:
            report(phase_soak(base, key, args.soak_s, args.concurrency))

    if args.url:  # a server someone else started: the phases that need no process control
        skipped = [p for p in phases if p in ("shutdown", "tp")]
        if skipped:
            print(f"skipped with --url (they start and stop their own servers): {', '.join(skipped)}")
            phases = [p for p in phases if p not in skipped]
        shared_phases(args.url.rstrip("/"), args.api_key)
    elif any(p in phases for p in ("fuzz", "disconnects", "soak", "overload", "auth", "fault")):
        key = "reliability-key"
        flags = (f"--api-key {key} --max-model-len {args.max_model_len} --max-num-seqs {args.max_num_seqs} "
                 f"--max-waiting-requests {args.max_waiting_requests} --max-queue-delay-ms {args.max_queue_delay_ms} "
                 f"--fault-injection {json.dumps({'forward_fail_token': FAIL_TOKEN}).replace(' ', '')} "
                 + args.server_args)
        server_log = os.path.join(workdir, "server.log")
        with running_server(args.dtype, None, flags, server_log) as (_, base):
            shared_phases(base, key)
        report(phase_server_log(server_log))
    own = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len), *extra]
    if "shutdown" in phases:
        report(phase_shutdown(own, workdir))
    if "corrupt" in phases:
        report(phase_corrupt_models(workdir, default_model_path()))
    if "tp" in phases:
        report(phase_tp_kill(own, workdir))
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": f"{cpu_line()}, {os.cpu_count()} logical CPUs",
            "command": "python -m tools.reliability " + " ".join(args.argv or [])}
    md = write_report(results, meta)
    with open(os.path.join(workdir, "reliability.md"), "w") as f:
        f.write(md)
    write_json(args.result_json or os.path.join(workdir, "results.json"), {"meta": meta, "results": results}, indent=1)
    print(md)
    print(f"results in {workdir}")
    return 0 if all(r["passed"] for r in results) else 1


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phases", default=None, help=f"comma-separated subset of {','.join(PHASES)} (default: all)")
    p.add_argument("--url", default=None,
                   help="run against this running server instead of starting one (fuzz, disconnects, soak, overload, "
                        "auth with --api-key, fault with --fault-token, corrupt; not shutdown or tp); give "
                        "--max-num-seqs as the server has it")
    p.add_argument("--api-key", default=None, help="with --url: the server's key")
    p.add_argument("--fault-token", type=int, default=None, help="with --url: the server's forward_fail_token")
    add_dtype_arg(p)
    p.add_argument("--server-args", default="", help="extra flags for every server the suite starts")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-waiting-requests", type=int, default=32,
                   help="the queue bound (keep >= 2 x --concurrency: the storm itself must not overload)")
    p.add_argument("--max-queue-delay-ms", type=float, default=20000)
    p.add_argument("--schema-examples", type=int, default=60, help="schemathesis cases per operation and mode")
    p.add_argument("--body-examples", type=int, default=400, help="hypothesis-drawn OpenAI bodies")
    p.add_argument("--disconnects", type=int, default=300, help="requests in the disconnect storm")
    p.add_argument("--concurrency", type=int, default=8, help="clients in the disconnect storm and the soak")
    p.add_argument("--burst", type=int, default=200, help="requests sent at once in the overload phase")
    p.add_argument("--soak-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=None)
    add_result_json_arg(p)
    p.set_defaults(argv=sys.argv[3:])
