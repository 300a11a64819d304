"""The kernels built for targets other than this CPU's ``-march=native``: every x86-64 level (built from an empty
cache and, where this CPU can execute it, tested) and ARM (cross-compiled), for tests/kernels/test_kernels.py.

These builds are minutes of compiler time that no other test waits on, and the rest of the suite keeps only about
1.4 of 2 cores busy (servers starting, clients waiting). So once the suite is collected, tests/conftest.py starts
them as background processes at the lowest priority (``nice 19``: the scheduler runs them on the cycles the other
tests leave idle), and their tests are moved to the end of the run, where they collect the results (waiting for any
build still going).
"""

import os
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent / "kernels"
# sapphirerapids: the AVX-512 path with qlinear's AMX tiles (qlinear_amx.h), compiled on every machine, run where the
# CPU has AMX (there it is the native build)
LEVELS = ["x86-64", "x86-64-v3", "x86-64-v4", "sapphirerapids"]
ARM_TARGETS = {  # target -> (object file magic, CPU type field: offset, bytes, value), vector path
    # zig's default CPUs: generic ARMv8 for Linux (NEON, no dot products), the Apple M1 for macOS (with them)
    "aarch64-linux-gnu": (b"\x7fELF", (18, 2, 183), "neon"),  # ELF e_machine EM_AARCH64
    "aarch64-macos": (bytes.fromhex("cffaedfe"), (4, 4, 0x0100000C), "neon+dotprod"),  # Mach-O CPU_TYPE_ARM64
}
# the tests that read these builds: the conftest runs them last
TESTS = ("test_kernels_build_and_pass_at_each_x86_level", "test_kernels_compile_for_arm")
# the level's pytest run: this folder's kernel tests, less what is the same for every level (the engine's and the
# loader's, which is Python; the GIL's release and the bindings'; the untied embedding's file lookup) and these
# builds' own tests
LEVEL_TESTS = ["test_kernels.py", "test_gguf_blocks.py", "-k",
               "not engine and not fused_and_torch and not each_x86_level and not compile_for_arm and not lock_left"
               " and not extension_loader and not release_the_gil and not untied_embedding"]


def _spawn(cmd: list[str], out: Path, env: dict | None = None) -> subprocess.Popen:
    """``cmd`` at the lowest priority, in its own process group (stop() ends its compilers too) but in this
    session: Linux's autogroups (``sched_autogroup_enabled``) give each session an equal share of the CPU and apply
    nice only within one, so a new session (setsid) took as much CPU as the whole suite (the first test, which
    builds the native kernels, 139 -> 231 s). Its output goes to ``out``'s files (a pipe that nobody reads until
    the end would stop a build that writes more than it holds)."""
    out.mkdir(parents=True, exist_ok=True)
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []  # without it: normal priority, still correct
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        proc = subprocess.Popen([*nice, *cmd], env=env, stdout=stdout, stderr=stderr, cwd=HERE, **group)
    proc.out = out
    return proc


def _level(base: Path, march: str, native: str):
    from pagedllm.kernels import can_run, path_macros

    if path_macros(march) == native:
        return "native"
    env = {**os.environ, "PAGEDLLM_CPU_MARCH": march, "MAX_JOBS": "1",
           "PAGEDLLM_CPU_UNITY": "1",  # one compile unit: the headers parsed once
           "PAGEDLLM_CPU_OPT": "-O0",  # a quarter of -O3's compile time; the native build tested is -O3
           "OMP_NUM_THREADS": "1",  # the threaded splits are the same source, tested natively
           "TORCH_EXTENSIONS_DIR": str(base / f"ext-{march}")}
    if can_run(march):
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *LEVEL_TESTS]
    else:  # this CPU lacks the level's instructions: the build must still compile (loading it would not run)
        cmd = [sys.executable, "-c", "import sys; from pagedllm.kernels import compile_only; "
               f"print(compile_only({march!r}, sys.argv[1]))", str(base / f"level-{march}")]
    return _spawn(cmd, base / f"level-{march}", env)


def _arm(base: Path, target: str):
    cxx = [sys.executable, "-m", "ziglang", "c++", "-target", target]  # zig's clang, without OpenMP (no omp.h)
    return _spawn([sys.executable, "-c", "import sys; from pagedllm.kernels import compile_only; "
                   f"print(compile_only(None, sys.argv[1], cxx={cxx!r}, openmp=False))", str(base / f"arm-{target}")],
                  base / f"arm-{target}")


def start(base: Path, runs: dict, levels=LEVELS, arm=tuple(ARM_TARGETS)) -> None:
    """Fills ``runs``: (kind, target) -> the running process, "native" for a level whose vector path is the native
    build's (the same kernel source, tested by this run: not built again), "skip: why", or the exception that
    stopped the start (raised again by its test, not during collection), for the x86-64 ``levels`` and the ARM
    targets ``arm`` (repeats counted once). Everything is written under ``base``."""
    from pagedllm.kernels import path_macros, target_march

    levels, arm = dict.fromkeys(levels), dict.fromkeys(arm)
    native = None
    for march in levels:
        try:
            if platform.machine() not in ("x86_64", "AMD64"):
                runs[("level", march)] = "skip: x86-64 levels: this is not an x86-64 machine"
                continue
            native = path_macros(target_march()) if native is None else native
            runs[("level", march)] = _level(base, march, native)
        except Exception as e:  # e.g. no compiler: its test fails with this
            runs[("level", march)] = e
    for target in arm:
        try:
            runs[("arm", target)] = _arm(base, target)
        except Exception as e:
            runs[("arm", target)] = e


def result(runs: dict, key: tuple, timeout: float = 1500):
    """The build's "native" / "skip: ..." or (exit status, stdout, stderr), once it has ended; raises the exception
    that stopped its start."""
    run = runs[key]
    if isinstance(run, Exception):
        raise run
    if isinstance(run, subprocess.Popen):
        try:
            run.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{key} still running after {timeout} s:\n"
                                 + (run.out / "stdout").read_text()[-3000:] + (run.out / "stderr").read_text()[-3000:])
        runs[key] = run = (run.returncode, (run.out / "stdout").read_text(), (run.out / "stderr").read_text())
    return run


def stop(runs: dict) -> None:
    """Ends the builds still running (a run stopped early, e.g. by -x or ^C)."""
    for run in runs.values():
        if isinstance(run, subprocess.Popen) and run.poll() is None:
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            run.wait()
