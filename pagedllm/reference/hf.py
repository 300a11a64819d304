"""The HuggingFace transformers reference for a GGUF file, as the benchmarks' HF baselines and the HF-identity tests
load it.

transformers reads a GGUF file by parsing its metadata and vocabulary in Python and de-quantizing every tensor:
~20 s for the 135M default model here. Its result is saved once (config, float32 safetensors, tokenizer) under
``config.cache_dir()/hf_reference/<key>``, keyed by the file's path, size and modification time and the
transformers version; loads read that folder (~0.4 s). The weights are transformers' own conversion of the file,
not pagedllm's loader, so the reference stays independent of the engine it checks.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil

from pagedllm.config import cache_dir, default_model_path, file_cache_key

logger = logging.getLogger(__name__)


def _save(model, tok, saved: str) -> None:
    """The de-quantized model as a plain checkpoint folder, written to a temporary folder and renamed into place.
    transformers' ``save_pretrained`` refuses a model loaded from GGUF (it is marked quantized), so the config goes
    without that mark and the weights through safetensors, a tied LM head left out (loading ties it to the
    embedding again, as for any tied checkpoint)."""
    from safetensors.torch import save_file

    tmp = f"{saved}.tmp{os.getpid()}"
    try:
        os.makedirs(tmp, exist_ok=True)
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        state = model.state_dict()
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        if os.path.isdir(saved) and not os.path.exists(os.path.join(saved, "config.json")):
            shutil.rmtree(saved, ignore_errors=True)  # a partial folder left by an interrupted clean-up
        try:
            os.replace(tmp, saved)
        except OSError:
            if not os.path.exists(os.path.join(saved, "config.json")):
                raise
            # another process saved it first: keep theirs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_saved(saved: str, torch_dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(saved)
    return tok, AutoModelForCausalLM.from_pretrained(saved, dtype=torch_dtype).eval()


def load_hf_reference(dtype: str = "float32", path: str | None = None):
    """(tokenizer, model in eval mode) of transformers for the GGUF file ``path`` (default: the embedded model).
    The first call converts the file and saves it; every call returns the saved copy, so a fresh machine (CI) and
    a warm cache run the same reference."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    path = os.path.abspath(path or default_model_path())
    saved = os.path.join(cache_dir(), "hf_reference", file_cache_key(path, transformers.__version__))
    if os.path.exists(os.path.join(saved, "config.json")):
        try:
            return _load_saved(saved, torch_dtype)
        except Exception as e:  # noqa: BLE001 - a damaged cache entry: convert again
            logger.warning("HF reference cache %s unreadable (%s); converting the GGUF file again", saved, e)
            shutil.rmtree(saved, ignore_errors=True)
    d, f = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    try:
        _save(model, tok, saved)
        return _load_saved(saved, torch_dtype)
    except Exception as e:  # noqa: BLE001 - no cache (a read-only disk, a full one): the conversion as it is
        logger.warning("could not cache the HF reference in %s: %s", saved, e)
        return tok, model.to(torch_dtype)
