"""Builds another version of the CPU kernels beside the installed ones, for the A/B scripts here: ``source`` is a
``csrc`` directory (``git archive REV pagedllm/kernels/csrc | tar -x``) or the single file the kernels once were
(``cpu_ops.cpp``). The module is named by the sources' hash, so both versions load in one process."""

from __future__ import annotations

from pathlib import Path

from torch.utils.cpp_extension import load

import pagedllm.kernels as K


def build_source(source: Path, march: str = "native", verbose: bool = False):
    source = Path(source)
    if source.is_dir():  # an older version may lack later files (pack.cpp, qlinear_amx.h)
        sources = tuple(source / s.name for s in K.SOURCES if (source / s.name).exists())
        hashed = sources + tuple(source / h.name for h in K.HEADERS if (source / h.name).exists())
    else:
        sources = hashed = (source,)
    name = f"pagedllm_cpu_ops_ab_{K._ident(march)}_{K.build_key(march, hashed)}"
    return load(name=name, sources=[str(s) for s in sources], extra_cflags=[*K.BASE_CFLAGS, f"-march={march}"],
                extra_ldflags=["-fopenmp"], verbose=verbose)
