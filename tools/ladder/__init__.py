"""`python -m tools.ladder`: the run (``run.py``: workloads, steps, measuring, the command) and its report
(``report.py``: gates, speedups, tables, chart); ``python -m tools.ladder`` runs it (``--phase``: a step-1 phase)."""

from tools.ladder.report import (GATE_WORKLOADS, TITLES, WORKLOADS, build_report, compute_gates, draft_section,
                                 four_bit, greedy_identity, speedup, write_chart, write_outputs)
from tools.ladder.run import (NGRAM_CONFIG, SHARED_SYSTEM, Step, _new_row, add_args, build_parser, build_workloads,
                              code_rewrite_prompts, counter_deltas, ladder_steps, main, resolve_draft_pair,
                              run_draft_step, run_eval, run_hf_step, run_server_step, selected_steps,
                              shared_prefix_prompt, single_stream_prompts, weights_bytes_from_log)

__all__ = ["GATE_WORKLOADS", "NGRAM_CONFIG", "SHARED_SYSTEM", "Step", "TITLES", "WORKLOADS", "_new_row", "add_args",
           "build_parser", "build_report", "build_workloads", "code_rewrite_prompts", "compute_gates", "counter_deltas",
           "draft_section", "four_bit", "greedy_identity", "ladder_steps", "main", "resolve_draft_pair",
           "run_draft_step", "run_eval", "run_hf_step", "run_server_step", "selected_steps", "shared_prefix_prompt",
           "single_stream_prompts", "speedup", "weights_bytes_from_log", "write_chart", "write_outputs"]
