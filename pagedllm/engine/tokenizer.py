"""Loads the tokenizer (transformers' fast tokenizers) that belongs to a model file or directory.

Building a fast tokenizer from a GGUF file's vocabulary takes seconds, so the result is saved once under the
cache directory (``$PAGEDLLM_CACHE_DIR``, default ``~/.cache/pagedllm``) keyed by the file's path, size and
modification time, and loaded from there afterwards. Loading those saved files still takes ~0.85 s for a
150k-token vocabulary (transformers parses the 7 MB ``tokenizer.json`` in Python, then rebuilds the tokenizer from
its vocabulary and merges), so the loaded object is also kept pickled beside them (keyed by the transformers and
tokenizers versions that wrote it, as its generic fast-tokenizer class: ``_generic``): ~0.45 s, most of it the Rust
tokenizer's own deserialisation. The pickle is the engine's own file in the user's cache, like the compiled kernels
beside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import types

import tokenizers

from pagedllm.config import cache_dir, file_cache_key
from pagedllm.gguf_file import GGUFFile
from pagedllm.model.archs import ARCHS

logger = logging.getLogger(__name__)


BUILD = 2  # how a GGUF file's tokenizer is built here: a change leaves the earlier builds' cache entries behind
# (2: a file's add_space_prefix: false is kept; BERT WordPiece vocabularies)


def cache_entry(path: str) -> str:
    """The folder where the tokenizer built from the GGUF file at ``path`` (absolute) is kept."""
    return os.path.join(cache_dir(), "tokenizers", f"{file_cache_key(path)}-{BUILD}")


def _pickle_name() -> str:
    import transformers

    return f"tokenizer-{transformers.__version__}-{tokenizers.__version__}.pkl"


def _generic(tok):
    """``tok`` as its generic fast-tokenizer class when its own class adds no behaviour (transformers 5's per-model
    tokenizer classes set class attributes and build the tokenizer in ``__init__``, nothing else): unpickling it
    then imports no ``transformers.models`` module (their import index scans every model's files, ~0.45 s). The
    class attributes it had are kept on the instance. A class with methods of its own is kept as it is."""
    cls = type(tok)
    base = next((b for b in cls.__mro__ if b.__module__.startswith("transformers.tokenization_utils")), cls)
    own = cls.__mro__[:cls.__mro__.index(base)]
    if not own or any(k != "__init__" and isinstance(v, (types.FunctionType, property, classmethod, staticmethod))
                      for klass in own for k, v in vars(klass).items()):
        return tok
    generic = base.__new__(base)
    generic.__dict__.update({k: v for klass in reversed(own) for k, v in vars(klass).items()
                             if not k.startswith("__")})
    generic.__dict__.update(tok.__dict__)
    return generic


def _save(tok, path: str) -> None:
    try:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(_generic(tok), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
        logger.warning("could not cache the tokenizer in %s: %s", path, e)


def _from_gguf(path: str):
    """transformers' tokenizer of a GGUF file, its class chosen from the file's architecture as ``AutoTokenizer``
    chooses it. Asked without the class, ``AutoTokenizer`` first builds the whole model config through the ``gguf``
    package's Python reader, which walks every string of the vocabulary (9.4 s of the 9.9 s for Qwen2.5-Coder's
    151k tokens, 12 s for Gemma 3's 262k); the tokenizer class itself reads only what it needs (0.9 s / 2.5 s). The
    result is the same tokenizer (tests/engine/test_tokenizer_cache.py)."""
    from transformers import AutoTokenizer, TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    directory, name = os.path.split(path)
    f = GGUFFile(path)
    if f.get("tokenizer.ggml.model") == "bert":
        return _word_piece_from_gguf(f)
    arch = ARCHS.get(f.get("general.architecture"))
    if arch is None:  # not one of ours (the engine will refuse the model): transformers' own way
        return AutoTokenizer.from_pretrained(directory, gguf_file=name)
    hf_type = arch.tokenizer_type or next((t for t in arch.hf_types if TOKENIZER_MAPPING_NAMES.get(t)), None)
    with _header_read_once(f, path):
        if hf_type is None:  # no class of its own (llama): the generic one, as AutoTokenizer falls back to
            tok = TokenizersBackend.from_pretrained(directory, gguf_file=name)
        else:
            tok = AutoTokenizer.from_pretrained(directory, gguf_file=name, tokenizer_type=hf_type)
    if f.get("tokenizer.ggml.add_space_prefix") is False:
        _no_space_prefix(tok)
    return tok


@contextlib.contextmanager
def _header_read_once(f: GGUFFile, path: str):
    """transformers' tokenizer reads the file's header again through its own reader (``read_gguf_metadata``), a
    string at a time from a numpy memory map: 1.9 s of a first start for Qwen2.5-Coder's 151k tokens and 151k
    merges. While the tokenizer is built, that reader gives what it would for ``path`` from the header ``f`` has
    already read (0.24 s): every value, string arrays it was not asked to keep as their lengths, the tensor names
    (tests/engine/test_tokenizer_cache.py: the same tokenizer as transformers' own build)."""
    try:
        from transformers.integrations.gguf import reader

        own = reader.read_gguf_metadata
    except (ImportError, AttributeError):  # another transformers generation: its own reader, as it is
        yield
        return
    target = os.path.realpath(path)

    def read(gguf_path: str, string_arrays=()):
        if os.path.realpath(gguf_path) != target:
            return own(gguf_path, string_arrays)
        meta = {k: len(v) if isinstance(v, list) and v and isinstance(v[0], str) and k not in string_arrays else v
                for k, v in f.fields.items()}
        return meta, tuple(t.name for t in f.tensors)

    reader.read_gguf_metadata = read
    try:
        yield
    finally:
        reader.read_gguf_metadata = own


def _no_space_prefix(tok) -> None:
    """A SentencePiece vocabulary whose file says ``add_space_prefix: false`` (Gemma 3's): no "▁" before the first
    word, as llama.cpp and the model's own tokenizer read it (transformers' GGUF conversion prepends one)."""
    backend = tok.backend_tokenizer
    for part in ("pre_tokenizer", "decoder"):
        obj = getattr(backend, part)
        if isinstance(obj, (tokenizers.pre_tokenizers.Metaspace, tokenizers.decoders.Metaspace)):
            setattr(backend, part, type(obj)(replacement=obj.replacement, prepend_scheme="never", split=obj.split))


def _word_piece_from_gguf(f: GGUFFile):
    """A BERT WordPiece tokenizer from a GGUF file's vocabulary (transformers builds none from GGUF). llama.cpp's
    converter marks a word's first piece with a leading "▁" and drops the "##" of the pieces inside a word; the
    special tokens ([CLS], [SEP], ...) keep their text. Lower-cased as the file says."""
    from transformers import BertTokenizerFast

    ids = {k: f.get(f"tokenizer.ggml.{k}_token_id") for k in ("unknown", "seperator", "padding", "bos", "mask")}
    special = {i for i in ids.values() if i is not None}
    vocab = {}
    for i, t in enumerate(f.get("tokenizer.ggml.tokens")):
        piece = t if i in special else (t[1:] if t.startswith("\u2581") else "##" + t)
        vocab.setdefault(piece, i)
    tokens = f.get("tokenizer.ggml.tokens")
    name = {k: tokens[i] for k, i in ids.items() if i is not None}
    return BertTokenizerFast(vocab=vocab, do_lower_case=bool(f.get("tokenizer.ggml.normalizer.lowercase", True)),
                             unk_token=name.get("unknown", "[UNK]"), sep_token=name.get("seperator", "[SEP]"),
                             pad_token=name.get("padding", "[PAD]"), cls_token=name.get("bos", "[CLS]"),
                             mask_token=name.get("mask", "[MASK]"))


def text_encoder(tok):
    """``tok.encode`` (text, add_special_tokens) -> ids, through the Rust tokenizer's single-text ``encode`` where
    transformers would call the same tokenizer with the same flags: a fast tokenizer whose class adds no Python of
    its own to encoding. transformers encodes one text through the batch call, which hands it to rayon's threads
    and releases and retakes the GIL: under a server's load (the engine thread's Python and torch threads on the
    same cores) that took ~45% of the event loop's time for 32 clients of a small embedding model, several times
    the encoding itself. Where the tokenizer holds truncation or padding settings (a truncating call leaves them)
    transformers' own path runs, which resets them."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # (another transformers generation: its own path)
        return tok.encode
    backend = getattr(tok, "backend_tokenizer", None)
    cls = type(tok)
    if (not isinstance(backend, tokenizers.Tokenizer) or cls.encode is not PreTrainedTokenizerBase.encode
            or cls._encode_plus is not TokenizersBackend._encode_plus or getattr(tok, "split_special_tokens", False)):
        return tok.encode

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens:
            return tok.encode(text, add_special_tokens=add_special_tokens)
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    return encode


def import_tokenizer_library() -> None:
    """Import transformers on the calling thread, before ``load_tokenizer`` runs on another. Imports on two threads
    at once can meet half-initialised modules (Python breaks a cycle of import locks by handing one thread the
    partial module): starts failed with "cannot import name 'version' from 'packaging'" or "No module named 'regex'"
    while the weights loaded beside the tokenizer. transformers' top level is ~0.5 s; its tokenizer modules load
    lazily, on the tokenizer's thread."""
    import transformers  # noqa: F401


def load_tokenizer(model_path: str):
    """A GGUF file carries its own vocabulary, merges and chat template; a directory has tokenizer files."""
    import transformers

    transformers.logging.set_verbosity_error()
    path = os.path.abspath(model_path)
    saved = cache_entry(path)
    pickled = os.path.join(saved, _pickle_name())
    if not os.path.isdir(model_path) and os.path.exists(pickled):
        try:
            with open(pickled, "rb") as f:
                return pickle.load(f)
        except Exception as e:  # noqa: BLE001 - a damaged or foreign pickle: load the saved files instead
            logger.warning("tokenizer cache %s unreadable (%s); reloading", pickled, e)
    # (imported only here: transformers' auto classes index every model module, ~0.45 s)
    from transformers import AutoTokenizer

    if os.path.isdir(model_path):
        return AutoTokenizer.from_pretrained(model_path)
    if os.path.exists(os.path.join(saved, "tokenizer_config.json")):
        try:
            tok = AutoTokenizer.from_pretrained(saved)
            _save(tok, pickled)
            return tok
        except Exception as e:  # a damaged cache entry: rebuild it
            logger.warning("tokenizer cache %s unreadable (%s); rebuilding", saved, e)
    tok = _from_gguf(path)
    try:
        tmp = f"{saved}.tmp{os.getpid()}"
        tok.save_pretrained(tmp)
        os.replace(tmp, saved)
    except OSError as e:
        logger.warning("could not cache the tokenizer in %s: %s", saved, e)
        return tok
    _save(tok, pickled)
    return tok
