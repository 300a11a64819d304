"""Shared checks and test infrastructure: greedy comparison against a reference, a live server subprocess, its
metrics, and the engine's model."""

import json
import socket
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"  # the server's default name for the embedded model


def model_of(llm):
    """The model an ``LLM`` runs (its runner's ``CausalLM``)."""
    return llm.engine.core.runner.model


def assert_greedy_close(ours_ids, ours_top, ref_ids, ref_logprobs, name=""):
    """Token-for-token equality, except at a near-tie (as vLLM's check_logprobs_close): at the first position
    where the two differ, each side's token must be among the other's top-5; the sequences are not compared
    after that. Returns the number of leading tokens that matched exactly.

    ours_top: per position, a list of our top-5 token ids. ref_logprobs: per position, the reference's
    log-softmax row (a tensor).
    """
    n = min(len(ours_ids), len(ref_ids))
    for i in range(n):
        if ours_ids[i] == ref_ids[i]:
            continue
        ref_top5 = ref_logprobs[i].topk(5).indices.tolist()
        assert ours_ids[i] in ref_top5 and ref_ids[i] in ours_top[i], (
            f"{name}: token {i} differs and is no near-tie: ours {ours_ids[i]} (ref top5 {ref_top5}), "
            f"ref {ref_ids[i]} (our top5 {ours_top[i]})"
        )
        gap = abs(ref_logprobs[i][ours_ids[i]].item() - ref_logprobs[i][ref_ids[i]].item())
        assert gap < 0.1, f"{name}: token {i} differs with a logprob gap of {gap:.3f} in the reference"
        return i
    assert len(ours_ids) == len(ref_ids), f"{name}: lengths differ: ours {len(ours_ids)}, ref {len(ref_ids)}"
    return n


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path_factory, *extra):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    fh = open(log, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--port", str(port),
         "--log-stats-interval", "1", *([] if "--dtype" in extra else ["--dtype", "float32"]), *extra],
        stdout=fh, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")


def wait_until_serving(proc, url: str, log, timeout_s: float = 60, path: str = "/v1/models") -> None:
    """Polls ``url + path`` until it answers 200; fails with the end of ``log`` (a path) if ``proc`` exits first or
    the time is up."""
    deadline = time.time() + timeout_s
    while True:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, f"{url} did not come up in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)


def scrape(base) -> dict:
    text = httpx.get(base + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("" if "finished_reason" not in s.labels else f"[{s.labels['finished_reason']}]")
            out[key] = s.value
    return out


WORDS = ("the a of to and in is it for on with as was at by an be this that from or are not have had one all "
         "cat dog sat mat paris france capital city river book read write code python model vector search query "
         "document text result title none task sentence similarity").split()


def word_piece_tokenizer(path) -> None:
    """A small BERT WordPiece tokenizer (lower case) written to ``path``: words, letters and digits."""
    from transformers import BertTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *".,:;!?'-|()", *chars, *(f"##{c}" for c in chars), *WORDS]
    path.mkdir(parents=True, exist_ok=True)
    BertTokenizerFast(vocab={t: i for i, t in enumerate(dict.fromkeys(vocab))}).save_pretrained(path)


def sentence_model(path, kind: str, seed: int = 0):
    """A tiny random-weight embedding model as a sentence-transformers folder at ``path``, built from
    transformers' own config and saved by sentence-transformers: ``bert`` (2 layers; mean pooling, a Dense layer
    with bias and tanh, Normalize) or ``gemma`` (EmbeddingGemma's shape in small: Gemma 3 layers with bidirectional attention, a
    sliding window of 8 on 5 of 6 layers, mean pooling, two Dense layers, Normalize, its query / document
    prompts). Returns the loaded ``SentenceTransformer``."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel, Gemma3TextConfig, Gemma3TextModel

    torch.manual_seed(seed)
    tok = path.parent / f"{path.name}-tokenizer"
    word_piece_tokenizer(tok)
    vocab = len(json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"])
    base = path.parent / f"{path.name}-base"
    if kind == "bert":
        # (heads of 32: the AMX encoder attention's smallest, what the default path runs where the CPU has tiles)
        model = BertModel(BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=128), add_pooling_layer=False)
    else:
        model = Gemma3TextModel(Gemma3TextConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=256, sliding_window=8,
            query_pre_attn_scalar=32, use_bidirectional_attention=True, pad_token_id=0, bos_token_id=2,
            eos_token_id=3))
    with torch.no_grad():  # larger weights than the init's, so that a wrong layer shows
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(base)
    for f in tok.iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    word = Transformer(str(base), max_seq_length=64)
    modules = [word, Pooling(word.get_embedding_dimension(), "mean")]
    prompts = None
    if kind == "gemma":  # EmbeddingGemma's head: two Dense layers without bias or activation
        modules += [Dense(64, 96, bias=False, activation_function=torch.nn.Identity()),
                    Dense(96, 48, bias=False, activation_function=torch.nn.Identity())]
        prompts = {"query": "task: search result | query: ", "document": "title: none | text: "}
    else:  # a Dense layer with a bias and an activation (some BERT models')
        modules += [Dense(64, 32, bias=True, activation_function=torch.nn.Tanh())]
    st = SentenceTransformer(modules=modules + [Normalize()], prompts=prompts, device="cpu")
    st.save(str(path))
    return SentenceTransformer(str(path), device="cpu")


def encoder_gguf(path, folder, kind: str, dense: bool = True) -> None:
    """The sentence-transformers folder ``folder`` (``sentence_model``) as llama.cpp's converter writes it: ``bert``
    or ``gemma-embedding``, tensors named by the gguf package's own tables, the WordPiece vocabulary in llama.cpp's
    convention ("▁" before a word's first piece, no "##"), Gemma's norms as 1 + w, its Dense layers as ``dense_2``
    / ``dense_3`` (``dense``: written)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    arch = gguf.MODEL_ARCH.BERT if kind == "bert" else gguf.MODEL_ARCH.GEMMA_EMBEDDING
    c = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_pooling_type(gguf.PoolingType.MEAN)
    if kind == "bert":
        w.add_layer_norm_eps(c["layer_norm_eps"])
    else:
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_rope_freq_base(c["rope_parameters"]["full_attention"]["rope_theta"])
        w.add_float32(f"{gguf.MODEL_ARCH_NAMES[arch]}.rope.freq_base_swa",
                      c["rope_parameters"]["sliding_attention"]["rope_theta"])
        w.add_sliding_window(c["sliding_window"])
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("bert")
    w.add_token_list([t if t.startswith("[") else (t[2:] if t.startswith("##") else "\u2581" + t) for t in tokens])
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("[") else gguf.TokenType.NORMAL for t in tokens])
    for key, tok in (("bos", "[CLS]"), ("eos", "[SEP]"), ("unk", "[UNK]"), ("sep", "[SEP]"), ("pad", "[PAD]"),
                     ("mask", "[MASK]")):
        getattr(w, f"add_{key}_token_id")(vocab[tok])
    w.add_bool("tokenizer.ggml.normalizer.lowercase", True)
    names = gguf.get_tensor_name_map(arch, c["num_hidden_layers"])
    for name, t in load_file(str(folder / "model.safetensors")).items():
        if name.endswith("position_ids") or name.startswith("pooler."):  # (the converter leaves them out too)
            continue
        key = "model." + name if kind != "bert" else name
        out = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert out is not None, name
        if kind != "bert" and name.endswith("norm.weight"):
            t = 1.0 + t
        w.add_tensor(out, np.ascontiguousarray(t, dtype=np.float32))
    if dense:
        for i, d in enumerate(sorted(folder.glob("*_Dense"))):
            w.add_tensor(f"dense_{i + 2}.weight", load_file(str(d / "model.safetensors"))["linear.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Every registered architecture: its one ``model/archs/`` module and the model class it is built as (a decoder's
# layers are ``layers/`` classes: DecoderLayer holding Attention and GatedMLP or MoE; BERT's PostNormLayer holding
# Attention and MLP)
ARCH_MODULES = {"llama": ("llama", "CausalLM"), "qwen2": ("qwen2", "CausalLM"), "qwen3": ("qwen3", "CausalLM"),
                "qwen3moe": ("qwen3moe", "CausalLM"), "qwen35": ("qwen3_5", "CausalLM"),
                "qwen35moe": ("qwen3_5_moe", "CausalLM"),
                "qwen3next": ("qwen3_next", "CausalLM"), "lfm2": ("lfm2", "CausalLM"), "lfm2moe": ("lfm2_moe", "CausalLM"),
                "granitehybrid": ("granite_hybrid", "CausalLM"), "gemma2": ("gemma2", "CausalLM"), "gemma3": ("gemma3", "CausalLM"),
                "gemma4": ("gemma4", "CausalLM"),
                "phi3": ("phi3", "CausalLM"), "smollm3": ("smollm3", "CausalLM"),
                "mistral3": ("ministral3", "CausalLM"), "gpt-oss": ("gpt_oss", "CausalLM"),
                "bert": ("bert", "BertEncoder"),
                "gemma-embedding": ("gemma_embedding", "BidirectionalLM")}


def add_default_vocab(w, bos: int, eos: int) -> None:
    """The default model's (SmolLM2's) vocabulary into a ``gguf.GGUFWriter``, with these bos / eos ids: what the
    tiny test models' GGUF files tokenize with."""
    from pagedllm.config import default_model_path
    from pagedllm.gguf_file import GGUFFile

    src = GGUFFile(default_model_path())
    for key, fn in (("model", w.add_tokenizer_model), ("pre", w.add_tokenizer_pre), ("tokens", w.add_token_list),
                    ("token_type", w.add_token_types), ("merges", w.add_token_merges)):
        fn(src.get(f"tokenizer.ggml.{key}"))
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)


def save_hf_and_gguf(folder, llm, model, write_gguf, name: str) -> tuple[str, str]:
    """A tiny HF model as an HF directory (``folder``/hf, the default model's tokenizer beside it) and as the GGUF
    file ``write_gguf(path, model)`` writes (``folder``/``name``.gguf): (directory, file)."""
    d = folder / "hf"
    model.save_pretrained(d, safe_serialization=True)
    llm.get_tokenizer().save_pretrained(d)
    path = str(folder / f"{name}.gguf")
    write_gguf(path, model)
    return str(d), path


def gguf_add(w, name: str, t, q8: bool = False) -> None:
    """A float32 tensor into a ``gguf.GGUFWriter``, or (``q8``) its Q8_0 blocks."""
    import gguf
    import numpy as np

    t = np.ascontiguousarray(t, dtype=np.float32)
    if q8:
        w.add_tensor(name, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        w.add_tensor(name, t)


def gguf_finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_stacked_experts(w, name: str, t) -> bool:
    """transformers' stacked experts of layer ``name`` as llama.cpp's converter writes them: (E, 2I, H) gate_up
    split into ffn_gate_exps and ffn_up_exps, (E, H, I) down as ffn_down_exps. False: not such a tensor."""
    import numpy as np

    if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return False
    i = name.split(".")[2]
    if name.endswith("experts.gate_up_proj"):
        gate, up = np.split(t, 2, axis=1)
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(up))
        return True
    w.add_tensor(f"blk.{i}.ffn_down_exps.weight", np.ascontiguousarray(t))
    return True
