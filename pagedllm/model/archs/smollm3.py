"""SmolLM3: llama's layers, but every 4th layer has no rotary (NoPE: its q and k enter attention as projected).
HF lists the layers that rotate (``no_rope_layers``: 1 rotates, 0 does not); llama.cpp fixes the step at 4 and
permutes q/k rows as for llama."""

from pagedllm.model.archs import Arch, GGUFMeta, llama

NO_ROPE_STEP = 4  # llama.cpp's n_no_rope_layer_step, and transformers' default no_rope_layer_interval


def from_gguf(meta: GGUFMeta) -> dict:
    layers = int(meta.kv("block_count"))
    return llama.from_gguf(meta) | {"no_rope_layers": tuple(i for i in range(layers) if (i + 1) % NO_ROPE_STEP == 0)}


def from_hf(hf: dict) -> dict:
    if hf.get("use_sliding_window"):
        raise ValueError("smollm3: use_sliding_window (windows on the NoPE layers) is not supported")
    layers, step = hf["num_hidden_layers"], hf.get("no_rope_layer_interval") or NO_ROPE_STEP
    rotates = hf.get("no_rope_layers") or [int((i + 1) % step != 0) for i in range(layers)]
    return {"no_rope_layers": tuple(i for i, r in enumerate(rotates) if not r)}


ARCH = Arch("smollm3", ("smollm3",), from_gguf, from_hf, gguf_permuted_qk=True)
