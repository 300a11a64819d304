"""Loads the tokenizer (transformers' fast tokenizers) that belongs to a model file or directory.

Building a fast tokenizer from a GGUF file's vocabulary takes seconds, so the result is saved once under the
cache directory (``$PAGEDLLM_CACHE_DIR``, default ``~/.cache/pagedllm``) keyed by the file's path, size and
modification time, and loaded from there afterwards.
"""

from __future__ import annotations

import logging
import os

from pagedllm.config import cache_dir, file_cache_key

logger = logging.getLogger(__name__)


def load_tokenizer(model_path: str):
    """A GGUF file carries its own vocabulary, merges and chat template; a directory has tokenizer files."""
    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import AutoTokenizer

    if os.path.isdir(model_path):
        return AutoTokenizer.from_pretrained(model_path)
    path = os.path.abspath(model_path)
    saved = os.path.join(cache_dir(), "tokenizers", file_cache_key(path))
    if os.path.exists(os.path.join(saved, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(saved)
        except Exception as e:  # a damaged cache entry: rebuild it
            logger.warning("tokenizer cache %s unreadable (%s); rebuilding", saved, e)
    directory, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    try:
        tmp = f"{saved}.tmp{os.getpid()}"
        tok.save_pretrained(tmp)
        os.replace(tmp, saved)
    except OSError as e:
        logger.warning("could not cache the tokenizer in %s: %s", saved, e)
    return tok
