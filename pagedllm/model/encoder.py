"""Encoders: the embedding models, whose every token attends to the whole text (both ways) and whose states are
pooled into one vector per text. No KV cache is read or written: each text is computed whole in one step
(``bidirectional_attention`` over the step's spans).

- ``BertEncoder``: the BERT family (``model.archs.bert``);
- ``BidirectionalLM``: a decoder architecture's layers run both ways (EmbeddingGemma: Gemma 3 layers whose sliding
  layers see the tokens within half the window on either side), the decoder's layers with another attention;
- ``SentenceHead``: a sentence-transformers folder's ``Dense`` layers after the pooling (``model.sentence``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pagedllm.layers.attention import bidirectional_attention
from pagedllm.layers.linear import build_linear, tensor_bytes
from pagedllm.layers.ops import TorchOps
from pagedllm.layers.weights import LinearBuild
from pagedllm.model.arch import ModelArchConfig
from pagedllm.model.decoder import CausalLM
from pagedllm.model.sentence import SentenceModules
from pagedllm.quant.policy import quantize_weight


class BidirectionalLM(CausalLM):
    """The decoder's layers (norms, rotary, QK-norm, GeGLU) with bidirectional attention (``Attention(causal=
    False)``); ``forward`` takes the step's spans (one per text) instead of a KV cache."""

    def __init__(self, cfg: ModelArchConfig, weights: dict, device: torch.device, dtype: torch.dtype,
                 build: LinearBuild | None = None) -> None:
        if cfg.attn_softcap:
            raise ValueError(f"{cfg.arch}: attention soft-capping is not supported in an encoder")
        super().__init__(cfg, weights, device, dtype, build, causal=False)
        self.ops = TorchOps()  # the fused rotary writes the KV cache that an encoder does not keep

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """input_ids, positions: (T,), each span a whole text -> final hidden states (T, H)."""
        none = [(None, None)] * len(self.layers)
        return self._layers(input_ids, positions, none, [spans] * (max(self.kv_group) + 1))


class BertEncoder:
    """Word + token-type + absolute position embeddings, LayerNorm; per layer: attention (biases), add and
    LayerNorm, a GELU MLP (biases), add and LayerNorm. Single texts: token type 0 everywhere."""

    def __init__(self, cfg: ModelArchConfig, weights: dict, device: torch.device, dtype: torch.dtype,
                 build: LinearBuild | None = None) -> None:
        """``build.linear_dtype``: the linears' weights in this dtype (bfloat16 GEMMs under float32 activations)."""
        build = build or LinearBuild()
        quant, linear_dtype = build.quant, build.linear_dtype
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.num_heads = self.num_kv_heads = cfg.num_heads
        self.scale = cfg.head_dim ** -0.5
        self.ops = TorchOps()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return weights.pop(name).to(device=device, dtype=dtype).contiguous()

        def linear(parts: list[str], layer_type: str):
            w = torch.cat([weights.pop(p) for p in parts])
            b = torch.cat([weights.pop(p + "_bias") for p in parts])
            if quant is not None:
                w = quantize_weight(w.float(), quant.scheme(layer_type), quant)
            lin = build_linear(w, b, device, linear_dtype or dtype, block_ops=build.block_ops)
            return lin.prepack(keep_weight=False) if lin.kind == "dense" else lin

        self.embed = take("embed")
        self.pos_embed = take("pos_embed")
        self.type_embed = take("type_embed")[0] if "type_embed" in weights else None
        self.embed_norm = (take("embed_norm"), take("embed_norm_bias"))
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            self.layers.append({
                "qkv": linear([p + "q", p + "k", p + "v"], "attn"), "o": linear([p + "o"], "attn"),
                "attn_norm": (take(p + "attn_norm"), take(p + "attn_norm_bias")),
                "up": linear([p + "up"], "mlp"), "down": linear([p + "down"], "mlp"),
                "mlp_norm": (take(p + "mlp_norm"), take(p + "mlp_norm_bias")),
            })

    def linears(self) -> dict[str, object]:
        return {f"layers.{i}.{n}": layer[n] for i, layer in enumerate(self.layers) for n in ("qkv", "o", "up", "down")}

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.pos_embed, *self.embed_norm] + [t for lin in self.linears().values()
                                                                    for t in lin.tensors()]
        tensors += [t for layer in self.layers for n in ("attn_norm", "mlp_norm") for t in layer[n]]
        return tensor_bytes(tensors)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """input_ids, positions: (T,), each span a whole text -> final hidden states (T, H)."""
        cfg = self.cfg
        size, eps, t = (cfg.hidden_size,), cfg.rms_norm_eps, input_ids.shape[0]
        h = self.embed[input_ids]
        if self.type_embed is not None:
            h = h + self.type_embed
        h = F.layer_norm(h + self.pos_embed[positions], size, *self.embed_norm, eps)
        n, d = cfg.num_heads, cfg.head_dim
        for layer in self.layers:
            q, k, v = layer["qkv"](h).view(t, 3, n, d).unbind(1)
            a = bidirectional_attention(q, k, v, spans, self.scale)
            h = F.layer_norm(h + layer["o"](a.reshape(t, n * d)), size, *layer["attn_norm"], eps)
            h = F.layer_norm(h + layer["down"](F.gelu(layer["up"](h))), size, *layer["mlp_norm"], eps)
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
