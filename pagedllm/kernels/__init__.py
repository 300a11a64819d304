"""Fused CPU kernels (``csrc/``: ``attention.cpp``, ``deltanet.cpp``, ``dense.cpp``, ``qlinear.cpp``,
``qlinear_k.cpp``, ``pack.cpp``, ``bindings.cpp``), compiled on first use with torch's C++ extension loader (the
sources side by side, one compiler process each).

The source has four vector paths chosen at compile time: AVX-512, AVX2 + FMA (x86-64-v3), NEON on 64-bit ARM (with
the dot-product instructions of ARMv8.2 for the packed-weight kernel where the target has them), and portable
scalar loops that compile anywhere. The engine builds it for ``-march=native`` once per machine kind and
source version (cached under torch's extensions directory; about 85 s on 2 cores of a Zen 4; the cache key hashes the
source, the flags, the CPU's model and feature flags, and the torch version). ``PAGEDLLM_CPU_MARCH`` builds for
another ``-march`` instead (an x86-64 level, to run e.g. the AVX2 path on an AVX-512 machine; ``armv8.2-a+dotprod``
on ARM, where a cross compiler has no ``native``). It needs a C++ compiler. Without one, or with
``PAGEDLLM_CPU_KERNELS=0``, ``cpu_ops()`` returns None, a warning is logged, and the model runs the same math as
separate torch operations (the start-up log names the path in use).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

try:
    import fcntl  # the build lock (POSIX)
except ImportError:
    fcntl = None

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / f for f in ("qlinear.cpp", "qlinear_k.cpp", "attention.cpp", "deltanet.cpp", "dense.cpp",
                                   "pack.cpp", "bindings.cpp"))
HEADERS = tuple(CSRC / f for f in ("common.h", "qlinear.h", "qlinear_amx.h", "ops.h"))
BASE_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")

# what each x86-64 micro-architecture level needs from /proc/cpuinfo's flags (levels 2 and up, as gcc defines them)
X86_LEVEL_FLAGS = {
    "x86-64": (),
    "x86-64-v2": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"),
    "x86-64-v3": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "bmi1", "bmi2", "f16c",
                  "fma", "abm", "movbe", "xsave"),
    "x86-64-v4": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "bmi1", "bmi2", "f16c",
                  "fma", "abm", "movbe", "xsave", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, feature flags) of the first processor in the text of /proc/cpuinfo (x86 "flags", ARM
    "Features")."""
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, sep, val = line.partition(":")
        if not sep:
            continue
        key, val = key.strip().lower(), val.strip()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = val
        elif key in ("flags", "features") and not flags:
            flags = frozenset(val.split())
    return model, flags


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """(CPU model name, feature flags) of this machine; without /proc/cpuinfo the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            model, flags = parse_cpuinfo(f.read())
    except OSError:
        model, flags = "", frozenset()
    return model or platform.processor() or platform.machine() or "unknown", flags


def can_run(march: str) -> bool:
    """Whether this CPU executes code built with ``-march=march`` (``native`` always; x86-64 levels by flag)."""
    if march == "native":
        return True
    if platform.machine() not in ("x86_64", "AMD64") or march not in X86_LEVEL_FLAGS:
        return False
    _, flags = cpu_info()
    return set(X86_LEVEL_FLAGS[march]) <= flags


# the predefined macros that choose the kernels' vector paths (``#if defined(...)`` in csrc/)
PATH_MACROS = ("__AVX2__", "__FMA__", "__F16C__", "__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512VNNI__",
               "__AVX512BF16__", "__AVX512VBMI__", "__AMX_TILE__", "__AMX_INT8__", "__AMX_BF16__", "__ARM_NEON",
               "__ARM_FEATURE_DOTPROD")


def path_macros(march: str) -> frozenset[str]:
    """Which of ``PATH_MACROS`` the compiler defines for ``-march=march``: two targets with the same set compile
    the same kernel source."""
    out = subprocess.run([os.environ.get("CXX", "c++"), f"-march={march}", "-dM", "-E", "-x", "c++", "/dev/null"],
                         capture_output=True, text=True, check=True).stdout
    defined = {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}
    return frozenset(m for m in PATH_MACROS if m in defined)


def build_cflags(march: str | None, opt: str | None = None) -> list[str]:
    """The compile flags for ``-march=march`` (None: the compiler's own target): BASE_CFLAGS, at the optimisation
    level ``opt`` or ``PAGEDLLM_CPU_OPT``'s where given (the x86-level tests build the levels other than the native
    one at -O0: their vector paths' logic is tested in a quarter of the compile time, while the native build that the
    rest of the suite and every user run stays -O3)."""
    opt = opt or os.environ.get("PAGEDLLM_CPU_OPT")
    return [opt if f == "-O3" and opt else f for f in BASE_CFLAGS] + ([f"-march={march}"] if march else [])


def build_key(march: str, sources: tuple[Path, ...] = SOURCES + HEADERS) -> str:
    """Hash of what decides the binary: sources, flags, torch version, and (for ``native``) the CPU itself."""
    h = hashlib.sha256()
    for source in sources:
        h.update(source.read_bytes())
    h.update(" ".join(build_cflags(march)).encode())
    h.update(torch.__version__.encode())
    if march == "native":
        model, flags = cpu_info()
        h.update(model.encode())
        h.update(" ".join(sorted(flags)).encode())
    return h.hexdigest()[:12]


def _ident(s: str) -> str:
    """``s`` with every character a C identifier cannot hold replaced by "_" (``armv8.2-a+dotprod``)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", s)


def _unity(out_dir: Path, name: str) -> Path:
    """A source file in ``out_dir`` that includes every kernel source: one compile unit that parses the headers once
    (where several builds already share the cores, one process per build costs less than one per source)."""
    unit = Path(out_dir) / f"kernels_{_ident(name)}.cpp"
    text = "".join(f'#include "{src}"\n' for src in SOURCES)
    if not unit.exists() or unit.read_text() != text:  # rewritten, it would be newer than the build: rebuilt
        unit.write_text(text)
    return unit


def build(march: str = "native", verbose: bool = False, unity: bool = False):
    """Compiles (or loads the cached build of) the kernels for ``-march=march``; raises on a failed build.
    ``unity``: the sources as one compile unit (``PAGEDLLM_CPU_UNITY=1``; the x86-level tests build three levels
    side by side)."""
    sources = SOURCES
    key = build_key(march)
    if unity:
        sources = (_unity(Path(tempfile.gettempdir()), f"unity_{march}_{key}"),)
        key += "_unity"
    name = f"pagedllm_cpu_ops_{_ident(march)}_{key}"  # a module name: no "-", "." or "+"
    cached = _import_built(name)
    if cached is not None:
        return cached
    from torch.utils.cpp_extension import load  # setuptools, 0.65 s: only where the kernels are built

    with _build_lock(name):
        return load(name=name, sources=[str(s) for s in sources], extra_cflags=build_cflags(march),
                    extra_ldflags=["-fopenmp"], verbose=verbose)


def extensions_dir(name: str) -> Path:
    """The folder where torch's extension loader builds the module ``name`` (``_get_build_directory``'s rule:
    ``$TORCH_EXTENSIONS_DIR``, else torch's user cache folder's ``torch_extensions/py311_cpu``), found without
    importing ``torch.utils.cpp_extension`` (which imports setuptools: 0.65 s of every start)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch import _appdirs

        accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None
                 else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")),
                            f"{py}_{accel}")
    return Path(root) / name


def _import_built(name: str):
    """The module ``name`` imported from its built file, as torch's loader imports it once its build is done, or
    None where there is none (or it does not import: then the loader, under the build lock, builds it). The name
    hashes the sources and flags (``build_key``), so a file of that name is that build."""
    path = extensions_dir(name) / f"{name}{'.pyd' if os.name == 'nt' else '.so'}"  # torch's LIB_EXT
    if not path.is_file() or (path.parent / "lock").exists():  # none, or a build under way (or interrupted)
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError as e:  # e.g. a file cut short by a killed link: built again
        logger.warning("the built kernels %s do not load (%s); building them again", path, e)
        return None


@contextlib.contextmanager
def _build_lock(name: str):
    """Held around torch's ``load``: one process at a time builds or loads ``name`` (an OS file lock, released when
    its holder exits, however it exits), and a ``lock`` file that torch's own lock left behind is removed first.
    torch creates that file for the length of every build or load and waits, with no timeout, while it exists: a
    start killed during the first build (Ctrl-C, a timeout) left it, and every later start hung silently. Logs
    that a build starts where none is cached (it takes one to two minutes, before any other start-up line)."""
    if fcntl is None:  # not a POSIX system: torch's own lock alone
        yield
        return
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    with open(build_dir / "pagedllm.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():  # no other pagedllm process is inside load() for this name: nobody holds it
            logger.warning("removing %s, left by a kernel build that was interrupted", stale)
            stale.unlink(missing_ok=True)
        if not (build_dir / f"{name}.so").exists():
            logger.info("building the CPU kernels (%s): one to two minutes, once per machine kind and version", name)
        yield


def compile_only(march: str | None, out_dir: str | Path, cxx: list[str] | None = None, openmp: bool = True) -> Path:
    """Compiles the kernels for ``-march=march`` to one object file without loading it, with the flags of
    ``build`` but its optimisation level: for a level this CPU cannot execute (loading that build runs its
    instructions in the module's start-up code: SIGILL). ``cxx``: another compiler command (default ``$CXX`` or
    ``c++``), e.g. a cross compiler for another architecture, whose target then comes with it (``march`` None);
    ``openmp`` False drops ``-fopenmp`` for a compiler without OpenMP (the kernels' ``omp simd`` pragmas are hints;
    their threads come from ATen). The sources compile as one unit (a file that includes each): one process parses
    the headers once, where the callers already run one compile per target side by side. Raises RuntimeError with
    the compiler's output on a failed build. At -O0, not -O3: the object is checked, never run, and the target's
    instructions and intrinsics are checked at any level (an intrinsic's immediate argument even more strictly, no
    constant being propagated into it), in a quarter of the time (67 -> 16.5 s for sapphirerapids; 37.5 -> 15.3 s
    for aarch64 with zig's clang)."""
    from torch.utils.cpp_extension import include_paths

    unit = _unity(Path(out_dir), march or (cxx[-1] if cxx else "default"))  # a cross compiler's target ends cxx
    obj = unit.with_suffix(".o")
    cflags = [f for f in build_cflags(march, "-O0") if openmp or f != "-fopenmp"]
    cmd = [*(cxx or [os.environ.get("CXX", "c++")]), *cflags, "-std=c++20", "-fPIC",
           "-DTORCH_EXTENSION_NAME=pagedllm_cpu_ops", "-DTORCH_API_INCLUDE_EXTENSION_H",
           *(f"-I{d}" for d in [*include_paths(), sysconfig.get_paths()["include"]]), "-c", str(unit), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        target = f"-march={march}" if march else " ".join(cxx) if cxx else "the compiler's default target"
        raise RuntimeError(f"building the kernels for {target} failed:\n{proc.stderr[-4000:]}")
    return obj


@functools.cache
def cpu_ops():
    """The compiled module (decode_attention, rms_norm, add_rms_norm, rope_write_kv, silu_and_mul, qlinear,
    dense_linear, isa),
    or None (disabled, or the build failed: logged as a warning)."""
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0":
        return None
    try:
        ops = build(target_march(), unity=os.environ.get("PAGEDLLM_CPU_UNITY") == "1")
        if os.environ.get("PAGEDLLM_CPU_AMX", "1") == "0":  # no AMX: qlinear on the AVX-512 tiles, encoders on SDPA
            ops.set_qlinear_amx(False)
        return ops
    except Exception as e:  # no compiler, or a failed build: the torch path still works
        logger.warning("fused CPU kernels unavailable (%s: %s); using plain torch operations",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def target_march() -> str:
    """``-march`` of the engine's build: ``native``, or ``PAGEDLLM_CPU_MARCH`` (e.g. ``x86-64-v3`` to run the AVX2
    path on an AVX-512 machine, as the kernel tests do for each level)."""
    return os.environ.get("PAGEDLLM_CPU_MARCH", "native")


def kernel_path() -> str:
    """A short description of the CPU kernel path in use, for logs and /health."""
    ops = cpu_ops()
    if ops is None:
        return "torch operations (fused CPU kernels off)"
    return f"fused CPU kernels ({ops.isa()}, -march={target_march()})"
