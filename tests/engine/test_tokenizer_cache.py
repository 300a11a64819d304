"""The tokenizer of a GGUF file, built once from its vocabulary, then loaded from the cache: from the saved files
and from the pickled object (what a start-up reads), with the same encodings, chat template and special tokens;
a damaged pickle falls back to the saved files and is rewritten. The pickle holds the generic fast-tokenizer class
(no ``transformers.models`` import when read)."""

from __future__ import annotations

import os

from transformers import PreTrainedTokenizerFast

from pagedllm.config import default_model_path
from pagedllm.engine import tokenizer as tk

TEXT = "def add(a, b):\n    return a + b  # héllo wörld, 你好 <|im_start|>"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def _same(a, b) -> None:
    assert isinstance(b, PreTrainedTokenizerFast)  # llguidance's requirement
    assert (a.padding_side, a.model_input_names) == (b.padding_side, b.model_input_names)
    assert a.encode(TEXT) == b.encode(TEXT) and len(a) == len(b)
    assert (a.eos_token_id, a.bos_token_id, a.pad_token_id) == (b.eos_token_id, b.bos_token_id, b.pad_token_id)
    assert a.chat_template == b.chat_template
    assert a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == b.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True)


def test_pickled_tokenizer_equals_the_built_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    saved = tk.cache_entry(os.path.abspath(path))
    pickled = os.path.join(saved, tk._pickle_name())
    built = tk.load_tokenizer(path)  # from the GGUF vocabulary; saves the files and the pickle
    assert os.path.exists(os.path.join(saved, "tokenizer_config.json")) and os.path.exists(pickled)
    loads = []
    real_load = tk.pickle.load
    monkeypatch.setattr(tk.pickle, "load", lambda f: loads.append(1) or real_load(f))
    again = tk.load_tokenizer(path)
    assert loads == [1]  # read from the pickle
    _same(built, again)

    with open(pickled, "wb") as f:  # damaged: the saved files are read and the pickle written again
        f.write(b"not a pickle")
    repaired = tk.load_tokenizer(path)
    _same(built, repaired)
    loads.clear()
    _same(built, tk.load_tokenizer(path))
    assert loads == [1]


def test_a_per_model_tokenizer_class_is_pickled_as_the_generic_one():
    """A per-model class (Qwen 2's, what transformers builds from the Qwen GGUF files) is saved as the generic fast
    tokenizer with its class attributes on the instance: the same encodings, padding side and input names."""
    import pickle

    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(set("abcdefghijklmnopqrstuvwxyzĠ ")))}
    vocab.update({"ab": len(vocab), "<|endoftext|>": len(vocab) + 1})
    tok = Qwen2Tokenizer(vocab=vocab, merges=[("a", "b")])
    generic = tk._generic(tok)
    assert type(generic).__module__.startswith("transformers.tokenization_utils")
    back = pickle.loads(pickle.dumps(generic))
    assert isinstance(back, PreTrainedTokenizerFast) and not isinstance(back, Qwen2Tokenizer)
    for text in ("abc abd", "zab<|endoftext|>"):
        assert back.encode(text) == tok.encode(text)
    assert (back.padding_side, back.model_input_names) == (tok.padding_side, tok.model_input_names)
    assert back.vocab_files_names == tok.vocab_files_names


def test_a_class_with_methods_of_its_own_is_pickled_as_it_is():
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    class Custom(Qwen2Tokenizer):
        def decode(self, *a, **k):
            return "custom"

    tok = Custom(vocab={"a": 0, "<|endoftext|>": 1}, merges=[])
    assert tk._generic(tok) is tok


def test_gguf_tokenizer_as_transformers_builds_it(tmp_path, monkeypatch):
    """The tokenizer a first start builds from a GGUF file (its class from the file's architecture) is the one
    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` builds through the whole model config: same class,
    vocabulary, encodings, special tokens and chat template."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    ours = tk.load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    assert type(ours) is type(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert ours.init_kwargs == theirs.init_kwargs and ours.all_special_tokens == theirs.all_special_tokens
    _same(ours, theirs)


def test_the_header_read_once_is_what_transformers_reader_reads():
    """While a tokenizer is built, transformers' GGUF reader answers from the header pagedllm already parsed: the
    same metadata (string arrays it was not asked to keep as their lengths) and tensor names; put back after."""
    from transformers.integrations.gguf import reader

    from pagedllm.gguf_file import GGUFFile

    path = default_model_path()
    keep = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    own = reader.read_gguf_metadata
    want = own(path, keep)
    with tk._header_read_once(GGUFFile(path), path):
        assert reader.read_gguf_metadata is not own
        got = reader.read_gguf_metadata(path, keep)
    assert reader.read_gguf_metadata is own
    assert got[1] == want[1] and got[0].keys() == want[0].keys()
    for k, v in want[0].items():
        assert got[0][k] == v, k


def test_text_encoder_gives_transformers_ids_without_its_batch_call():
    """The engine's text encoder (``tokenizer.text_encoder``) calls the Rust tokenizer's single-text encode, not
    transformers' batch path: the same ids, with and without special tokens, also after a truncating call (the
    tokenizer keeps its truncation: then transformers' path, which resets it, runs). A class that encodes in
    Python of its own keeps its own path."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    tok = tk.load_tokenizer(default_model_path())
    encode = tk.text_encoder(tok)
    assert encode != tok.encode  # the single-text path was chosen
    for text in (TEXT, "", "  two  spaces", "<|im_start|>user\nHi<|im_end|>"):
        for special in (True, False):
            assert encode(text, add_special_tokens=special) == tok.encode(text, add_special_tokens=special)
    tok(TEXT, truncation=True, max_length=3)  # leaves the backend truncating
    assert tok.backend_tokenizer.truncation is not None
    assert encode(TEXT) == tok.encode(TEXT) and len(encode(TEXT)) > 3

    class Custom(Qwen2Tokenizer):
        def encode(self, text, **kw):
            return [7]

    custom = Custom(vocab={"a": 0, "<|endoftext|>": 1}, merges=[])
    assert tk.text_encoder(custom)("a") == [7]
