"""Encoders: the embedding models, whose every token attends to the whole text (both ways) and whose states are
pooled into one vector per text. No KV cache is read or written: each text is computed whole in one step
(``bidirectional_attention`` over the step's spans).

- ``BertEncoder``: the BERT family (``model.archs.bert``), its layers ``layers.encoder_layer.PostNormLayer``;
- ``BidirectionalLM``: a decoder architecture's layers run both ways (EmbeddingGemma: Gemma 3 layers whose sliding
  layers see the tokens within half the window on either side), the decoder's layers with another attention;
- ``SentenceHead``: a sentence-transformers folder's ``Dense`` layers after the pooling (``model.sentence``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pagedllm.layers.encoder_layer import PostNormLayer
from pagedllm.layers.linear import tensor_bytes
from pagedllm.layers.ops import choose_ops
from pagedllm.layers.weights import LinearBuild, WeightSource
from pagedllm.model.arch import ModelArchConfig
from pagedllm.model.decoder import CausalLM
from pagedllm.model.sentence import SentenceModules


class BidirectionalLM(CausalLM):
    """The decoder's layers (norms, rotary, QK-norm, GeGLU) with bidirectional attention (``Attention(causal=
    False)``); ``forward`` takes the step's spans (one per text) instead of a KV cache."""

    def __init__(self, cfg: ModelArchConfig, weights: dict, device: torch.device, dtype: torch.dtype,
                 build: LinearBuild | None = None) -> None:
        if cfg.attn_softcap:
            raise ValueError(f"{cfg.arch}: attention soft-capping is not supported in an encoder")
        super().__init__(cfg, weights, device, dtype, build, causal=False)
        self.ops = choose_ops(device, dtype, encoder=True, linear_dtype=build.linear_dtype if build else None,
                              final_norm=self.norm)  # (the pooled rows stay float32)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """input_ids, positions: (T,), each span a whole text -> final hidden states (T, H)."""
        none = [(None, None)] * len(self.layers)
        return self._layers(input_ids, positions, none, [spans] * (max(self.kv_group) + 1)).to(self.dtype)


class BertEncoder:
    """Word + token-type + absolute position embeddings, LayerNorm, then post-norm layers (``layers.encoder_layer``:
    attention with biases, add and LayerNorm, a GELU MLP with biases, add and LayerNorm) on ``TorchOps``. Single
    texts: token type 0 everywhere."""

    def __init__(self, cfg: ModelArchConfig, weights: dict, device: torch.device, dtype: torch.dtype,
                 build: LinearBuild | None = None) -> None:
        """``build.linear_dtype``: the linears' weights in this dtype (bfloat16 GEMMs under float32 activations)."""
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.num_heads = self.num_kv_heads = cfg.num_heads  # (what the runner sizes its cache tensors by)
        self.ops = choose_ops(device, dtype, encoder=True, linear_dtype=build.linear_dtype if build else None)
        src = WeightSource(weights, device, dtype, build or LinearBuild())
        self.embed = src.norm("embed")  # (tables: float rows in the model's dtype, as the norms)
        self.pos_embed = src.norm("pos_embed")
        self.type_embed = src.norm("type_embed")[0] if "type_embed" in src else None
        self.embed_norm = (src.norm("embed_norm"), src.norm("embed_norm_bias"))
        self.layers = [PostNormLayer.load(src, f"layers.{i}.", cfg.num_heads, cfg.head_dim, cfg.hidden_act,
                                          cfg.rms_norm_eps) for i in range(cfg.num_layers)]
        for lin in self.linears().values():
            if lin.kind == "dense":
                lin.prepack(keep_weight=False)

    def linear_slots(self):
        for i, layer in enumerate(self.layers):
            yield from layer.linear_slots(f"layers.{i}.")

    def linears(self) -> dict[str, object]:
        return {name: getattr(owner, attr) for name, owner, attr in self.linear_slots()}

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.pos_embed, *self.embed_norm] + [t for lin in self.linears().values()
                                                                    for t in lin.tensors()]
        tensors += [t for layer in self.layers for t in layer.norms().values()]
        return tensor_bytes(tensors)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """input_ids, positions: (T,), each span a whole text -> final hidden states (T, H)."""
        h = self.embed[input_ids]
        if self.type_embed is not None:
            h = h + self.type_embed
        h = self.ops.layer_norm(h + self.pos_embed[positions], *self.embed_norm, self.cfg.rms_norm_eps)
        x = h
        for layer in self.layers:
            h, x = layer(h, x, spans, self.ops)
        return h


def build_encoder(cfg: ModelArchConfig, weights: dict, device: torch.device, dtype: torch.dtype,
                  build: LinearBuild | None = None):
    cls = BertEncoder if cfg.arch == "bert" else BidirectionalLM
    return cls(cfg, weights, device, dtype, build)


class SentenceHead:
    """The ``Dense`` layers after the pooling, in float32 (a few per text): the vector as sentence-transformers
    makes it before its ``Normalize``."""

    def __init__(self, modules: SentenceModules | None, device: torch.device, weights: list | None = None) -> None:
        """From a sentence-transformers folder's modules, or ``weights``: a GGUF file's dense weights in order
        (llama.cpp's ``dense_2`` / ``dense_3``: no bias, no activation)."""
        self.layers = [(w.float().to(device), None, None) for w in weights or ()]
        for spec in modules.dense if modules is not None else ():
            st = os.path.join(spec.path, "model.safetensors")
            w = load_file(st) if os.path.exists(st) else torch.load(os.path.join(spec.path, "pytorch_model.bin"),
                                                                     weights_only=True)
            weight = w["linear.weight"].float().to(device)
            if tuple(weight.shape) != (spec.out_features, spec.in_features):
                raise ValueError(f"{spec.path}: weight of shape {tuple(weight.shape)}, the config says "
                                 f"({spec.out_features}, {spec.in_features})")
            bias = w["linear.bias"].float().to(device) if spec.bias else None
            self.layers.append((weight, bias, torch.tanh if spec.activation == "tanh" else None))

    @torch.inference_mode()
    def __call__(self, vec: torch.Tensor) -> torch.Tensor:
        for weight, bias, act in self.layers:
            vec = F.linear(vec, weight, bias)
            if act is not None:
                vec = act(vec)
        return vec
