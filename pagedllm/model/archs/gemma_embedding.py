"""EmbeddingGemma as llama.cpp writes it (``gemma-embedding``): Gemma 3's layers and tensor names, run as an encoder
(bidirectional attention; the sliding layers see half their window on either side), the sliding layers' rotary
base in ``rope.freq_base_swa``, mean pooling from the file; its two Dense layers are the file's ``dense_2`` /
``dense_3`` where the converter wrote them. From a sentence-transformers folder it is ``gemma3`` with
``use_bidirectional_attention``."""

from pagedllm.model.archs import Arch, GGUFMeta, gemma3


def from_gguf(meta: GGUFMeta) -> dict:
    out = gemma3.from_gguf(meta)
    out["rope_local_theta"] = float(meta.kv("rope.freq_base_swa", 10000.0))
    return out | {"encoder": True, "tie_word_embeddings": True, "stop_token_ids": ()}


ARCH = Arch("gemma-embedding", (), from_gguf, gguf_global_names={"dense_2.weight": "pool_dense.0",
                                                                  "dense_3.weight": "pool_dense.1"},
            tokenizer_type="gemma3_text")  # the folder's tokenizer (the generic one prefixes a first word's space)
