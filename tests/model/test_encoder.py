"""Embedding models (encoders) against sentence-transformers on the same tiny random weights, made from
transformers' own configs and saved by sentence-transformers: a BERT (mean pooling, Normalize) and an
EmbeddingGemma in small (Gemma 3 layers both ways, sliding window 8 on 5 of 6 layers, two Dense layers, its
prompts)."""

import json

import numpy as np
import pytest
import torch

from helpers import ARCH_MODULES, encoder_gguf, sentence_model
from pagedllm import LLM
from pagedllm.model.sentence import read_sentence_modules
from pagedllm.kernels import cpu_info, cpu_ops
from pagedllm.worker.model_runner import ENCODER_ROW_ALIGN
from pagedllm.worker.plan import encoder_linear_dtype

TEXTS = ["the cat sat on the mat", "paris is the capital of france", "a",
         " ".join(["the dog read a book in the city"] * 6),  # 50 tokens: past the sliding layers' +-4
         "python code: search, write, read!"]


@pytest.fixture(scope="module", params=["bert", "gemma"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("enc") / request.param
    return request.param, path, sentence_model(path, request.param)


def test_vectors_equal_sentence_transformers(model):
    kind, path, st = model
    llm = LLM(model=str(path), dtype="float32")
    runner = llm.engine.core.runner
    assert runner.arch.encoder and llm.engine.is_embedding_model
    assert not llm.engine.core.config.cache.enable_prefix_caching  # nothing is cached for a text computed whole
    together = np.array([o.embedding for o in llm.embed(TEXTS, use_tqdm=False)])  # one step, all texts
    assert np.abs(together - st.encode(TEXTS)).max() <= 1e-5
    rows, forward = [], runner.model.forward
    runner.model.forward = lambda ids, pos, spans: rows.append(len(ids)) or forward(ids, pos, spans)
    alone = np.array([llm.embed(t, use_tqdm=False)[0].embedding for t in TEXTS])
    assert np.abs(alone - together).max() <= 1e-6  # (each step padded to its own number of rows)
    assert rows and all(r % ENCODER_ROW_ALIGN == 0 for r in rows), rows  # the rows oneDNN's GEMMs are built for
    if kind == "gemma":  # its prompts, by name, as sentence-transformers prepends them
        for name in ("query", "document"):
            got = np.array([o.embedding for o in llm.embed(TEXTS, prompt_name=name, use_tqdm=False)])
            assert np.abs(got - st.encode(TEXTS, prompt_name=name)).max() <= 1e-5
        with pytest.raises(ValueError, match="unknown prompt_name 'nope'"):
            llm.embed("x", prompt_name="nope")
    with pytest.raises(ValueError, match="embedding model"):  # no text from an encoder
        llm.generate("the cat")


def test_length_limit_and_truncation(model):
    _, path, st = model
    llm = LLM(model=str(path), dtype="float32")
    assert llm.engine.max_model_len == st.max_seq_length == 64  # the modules' max_seq_length
    long = " ".join(["the cat sat on the mat"] * 20)  # > 64 tokens
    with pytest.raises(ValueError, match="maximum input length is 64"):
        llm.embed(long)
    got = llm.embed(long, truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(got.prompt_token_ids) == 64
    assert np.abs(np.array(got.embedding) - st.encode(long)).max() <= 1e-5  # truncated as sentence-transformers


def test_default_is_bf16_linears_only_with_bf16_dot_products(model, monkeypatch):
    assert encoder_linear_dtype(frozenset({"avx2", "avx512_bf16"}))[0] == torch.bfloat16
    assert encoder_linear_dtype(frozenset({"amx_bf16"}))[0] == torch.bfloat16
    assert encoder_linear_dtype(frozenset({"avx2", "fma"}))[0] is None
    kind, path, st = model
    kernels, tiles = cpu_ops(), []
    if kernels is not None and kernels.encoder_attention_tiles():  # BERT's attention on them (bfloat16 q, k, v)
        real = kernels.encoder_attention
        monkeypatch.setattr(kernels, "encoder_attention", lambda *a: tiles.append(1) or real(*a))
    llm = LLM(model=str(path))
    runtime = llm.engine.runtime
    want = encoder_linear_dtype(cpu_info()[1])[0]
    assert runtime["dtype"] == "float32" and runtime.get("linear_dtype") == (want and "bfloat16")
    assert "dtype" in runtime["why"]
    got = np.array([o.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    ref = st.encode(TEXTS)
    assert ((got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)).min() >= 0.9999
    # where the tiles run, BERT's default path used them (Gemma's q and k are rotated in float32: torch's SDPA)
    assert bool(tiles) == (kind == "bert" and kernels is not None and kernels.encoder_attention_tiles()
                           and runtime.get("linear_dtype") == "bfloat16")


def test_sentence_modules_old_and_new_layouts(tmp_path):
    def folder(pooling: dict, dense: dict | None = None, name="m"):
        d = tmp_path / name
        (d / "1_Pooling").mkdir(parents=True)
        mods = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        if dense is not None:
            (d / "2_Dense").mkdir()
            (d / "2_Dense" / "config.json").write_text(json.dumps(dense))
            mods.append({"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        mods.append({"idx": 3, "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"})
        (d / "modules.json").write_text(json.dumps(mods))
        (d / "sentence_bert_config.json").write_text('{"max_seq_length": 256}')
        return str(d)

    old = read_sentence_modules(folder({"word_embedding_dimension": 8, "pooling_mode_cls_token": True}))
    assert (old.pooling, old.normalize, old.max_seq_length, old.dense) == ("cls", True, 256, ())
    new = read_sentence_modules(folder({"embedding_dimension": 8, "pooling_mode": "lasttoken"},
                                       {"in_features": 8, "out_features": 4, "bias": False,
                                        "activation_function": "torch.nn.modules.activation.Tanh"}, "n"))
    assert new.pooling == "last" and new.dense[0].activation == "tanh" and new.dimension == 4
    with pytest.raises(ValueError, match="pooling .*max"):
        read_sentence_modules(folder({"pooling_mode": "max"}, name="x"))
    with pytest.raises(ValueError, match="residual"):
        read_sentence_modules(folder({"pooling_mode": "mean"}, {"in_features": 8, "out_features": 8,
                                                                "use_residual": True}, "r"))
    assert read_sentence_modules(str(tmp_path)) is None  # not a sentence-transformers folder


def test_gguf_files_as_llama_cpp_writes_them(model, tmp_path):
    """``bert`` and ``gemma-embedding`` GGUF files of the same weights: their vectors equal sentence-transformers'
    (the WordPiece vocabulary rebuilt from the file; EmbeddingGemma's Dense layers from dense_2 / dense_3, or
    without them the pooled states, as llama.cpp gives them)."""
    kind, path, st = model
    gguf_path = tmp_path / f"{kind}.gguf"
    encoder_gguf(gguf_path, path, kind)
    llm = LLM(model=str(gguf_path), dtype="float32")
    arch = llm.engine.core.runner.arch.arch
    assert arch == {"bert": "bert", "gemma": "gemma-embedding"}[kind]
    built = llm.engine.core.runner.model
    assert type(built).__name__ == ARCH_MODULES[arch][1]
    # the layers are ``layers/`` classes: BERT's post-norm layer, or the decoder's layers, both ways
    assert {(type(la).__name__, type(la.attn).__name__, type(la.mlp).__name__, la.attn.causal)
            for la in built.layers} == {("PostNormLayer", "Attention", "MLP", False) if kind == "bert" else
                                        ("DecoderLayer", "Attention", "GatedMLP", False)}
    assert [llm.engine.encode_text(t) for t in TEXTS] == [st.tokenizer(t)["input_ids"] for t in TEXTS]
    got = np.array([o.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    if kind == "bert":  # its Dense layer (bias, tanh) is a sentence-transformers module llama.cpp does not write
        pooled = np.array([v.mean(0).numpy() for v in st.encode(TEXTS, output_value="token_embeddings")])
        assert np.abs(got - pooled / np.linalg.norm(pooled, axis=1, keepdims=True)).max() <= 1e-5
        return
    assert np.abs(got - st.encode(TEXTS)).max() <= 1e-5
    bare = tmp_path / "bare.gguf"
    encoder_gguf(bare, path, kind, dense=False)
    got = np.array([o.embedding for o in LLM(model=str(bare), dtype="float32").embed(TEXTS, use_tqdm=False)])
    pooled = np.array([v.mean(0).numpy() for v in st.encode(TEXTS, output_value="token_embeddings")])
    assert np.abs(got - pooled / np.linalg.norm(pooled, axis=1, keepdims=True)).max() <= 1e-5


def test_a_cross_encoder_is_refused(tmp_path):
    """A BERT with a classification head (a cross-encoder reranker) is not an embedding model: refused by name."""
    path = tmp_path / "bert"
    sentence_model(path, "bert")
    cfg = json.loads((path / "config.json").read_text()) | {"architectures": ["BertForSequenceClassification"]}
    d = tmp_path / "cross"
    d.mkdir()
    for f in path.iterdir():
        if f.is_file():
            (d / f.name).write_bytes(f.read_bytes())
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="BertForSequenceClassification is not supported"):
        LLM(model=str(d), dtype="float32")
