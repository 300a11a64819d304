"""The reliability harness: `python -m tools.reliability` (``cli.py``), its phases (``phases.py``: bad input,
disconnects, overload, faults, shutdown, soak), what they read off a server (``probes.py``) and the API fuzzer
(``fuzz.py``). tests/test_reliability.py runs the same phases smaller."""

from pagedllm.bench.compare import wait_healthy
from tools.reliability import fuzz
from tools.reliability.cli import PHASES, add_args, main, write_report
from tools.reliability.phases import (_launch, phase_auth, phase_corrupt_models, phase_disconnects,
                                      phase_forward_fault, phase_fuzz, phase_overload, phase_server_log,
                                      phase_shutdown, phase_soak, phase_tp_kill)
from tools.reliability.probes import (FAIL_TOKEN, GREEDY_PROMPTS, LOG_ERRORS, auth, greedy_outputs,
                                      kv_settled, server_info)

__all__ = ["FAIL_TOKEN", "GREEDY_PROMPTS", "LOG_ERRORS", "PHASES", "_launch", "add_args", "auth", "fuzz",
           "greedy_outputs", "kv_settled", "main", "phase_auth", "phase_corrupt_models", "phase_disconnects",
           "phase_forward_fault", "phase_fuzz", "phase_overload", "phase_server_log", "phase_shutdown", "phase_soak",
           "phase_tp_kill", "server_info", "wait_healthy", "write_report"]
