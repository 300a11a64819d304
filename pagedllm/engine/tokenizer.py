"""Loads the tokenizer (transformers' fast tokenizers) that belongs to a model file or directory."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def load_tokenizer(model_path: str):
    """A GGUF file carries its own vocabulary, merges and chat template; a directory has tokenizer files."""
    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import AutoTokenizer

    if os.path.isdir(model_path):
        return AutoTokenizer.from_pretrained(model_path)
    directory, name = os.path.split(os.path.abspath(model_path))
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)
