"""The decoder-only transformer every registered architecture (``model.archs``) assembles, over flat token batches
and a paged KV cache: llama's layers, with the variants an architecture's ``ModelArchConfig`` picks (q/k/v biases,
QK-norm, GeGLU, sandwich norms, scaled embeddings, sliding-window layers with their own rotary base, rotary
scaling, logit soft-capping).

The step's tokens of all sequences are one flat (T, hidden) batch: every linear layer runs once per step for the
whole batch; only attention looks at sequence boundaries (through ``AttentionMetadata``). q/k/v and gate/up
projections are fused into one matmul each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import AttentionMetadata, paged_attention
from pagedllm.layers.linear import build_linear, tensor_bytes
from pagedllm.layers.norm import rms_norm
from pagedllm.layers.rotary import RotaryEmbedding, rope_inv_freq
from pagedllm.model.arch import ModelArchConfig, tp_layout
from pagedllm.quant.formats import concat, dequantize
from pagedllm.quant.policy import QuantPolicy, quantize_weight

LM_HEAD_DENSE_MIN_TOKENS = 2  # with a dense copy kept (--quant-dense-min-tokens), the head uses it from 2 rows
# The fused CPU path runs a step's MLP in pieces of this many rows: a 2048-token prefill step's gate/up output is
# ~150 MB for a 1.5B model (a fresh mmap, page-faulted in, on every layer), 256 rows' ~18 MB is reused from the heap
# and stays in cache between gate/up, the activation and down. The kernels' rows do not depend on their batch, so
# the results are the same.
MLP_ROWS = 256
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu}
NORMS = ("input_norm", "post_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")


class CausalLM:
    def __init__(self, cfg: ModelArchConfig, weights: dict, device: torch.device, dtype: torch.dtype,
                 quant: QuantPolicy | None = None, tp=None, dense_min_tokens: int = 0, block_ops=None,
                 head_dense_min_tokens: int | None = None, dense_dtype: torch.dtype = torch.bfloat16,
                 kv_dtype: torch.dtype | None = None, linear_dtype: torch.dtype | None = None) -> None:
        """Takes (and empties) ``weights``, named as ``model.loader`` names them.

        ``tp`` (a ``pagedllm.distributed.group.TPGroup``): the weights are this rank's shard
        (``pagedllm.distributed.sharding.shard_weights``); the model keeps its rank's heads, all-reduces after the
        row-parallel ``o``/``down`` and the vocabulary-parallel embedding, and all-gathers the logits. None: the
        whole model in this process.

        A weight is a float tensor, or already quantized (``QuantizedWeight`` / ``Fp8Weight``, e.g. from a
        quantized checkpoint, where fused weights are stored under their fused names ``qkv`` / ``gate_up``).
        ``quant`` quantizes float weights at load time (round to nearest) by layer type. ``block_ops`` (the fused
        CPU kernels): integer weights in groups of 32 run through their ``qlinear`` kernel (``BlockQuantLinear``).
        ``dense_min_tokens`` > 0: packed layers also keep a ``dense_dtype`` copy, used for steps of at least that
        many tokens (the LM head: ``head_dense_min_tokens``, by default the smaller of the two). ``kv_dtype``:
        the dtype of the K/V caches it is run with (default ``dtype``; a bfloat16 cache under float32 activations
        rounds k and v as they are written, and every attention reads them back from the cache).
        ``linear_dtype``: the layers' float linear weights in this dtype (bfloat16 under float32 activations: the
        GEMMs in bfloat16, the residual stream, norms and attention in float32; the embedding and head keep
        ``dtype``)."""
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.tp = tp
        # this rank's share (all of it without tensor parallelism)
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.vocab_start, self.vocab_per_rank = 0, cfg.vocab_size
        if tp is not None:
            lay = tp_layout(cfg, tp.world_size, tp.rank)
            self.num_heads, self.num_kv_heads = lay.num_heads, lay.num_kv_heads
            self.vocab_start, self.vocab_per_rank = lay.vocab_start, lay.vocab_per_rank

        def pop(name: str):
            # pop: each loaded array is released as soon as it is placed (fused), so loading peaks near one
            # copy of the weights instead of two
            if name not in weights:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return weights.pop(name)

        def take(name: str) -> torch.Tensor:
            return pop(name).to(device=device, dtype=dtype).contiguous()

        def take_norm(name: str) -> torch.Tensor:  # float32 where the architecture's norm multiplies in float32
            return pop(name).to(device=device, dtype=torch.float32 if cfg.norm_float32 else dtype).contiguous()

        def linear(fused: str, parts: list[str], layer_type: str, bias: torch.Tensor | None = None,
                   dense: bool = True):
            if fused in weights:
                w = pop(fused)
            else:
                ws = [pop(p) for p in parts]
                # the block kernel packs fused parts from their own codes (no concatenated copy of a byte per weight)
                w = torch.cat(ws, dim=0) if isinstance(ws[0], torch.Tensor) else concat(
                    ws, defer_codes=block_ops is not None)
            if isinstance(w, torch.Tensor) and quant is not None:
                w = quantize_weight(w.float(), quant.scheme(layer_type), quant)
            min_tokens = dense_min_tokens if dense else 0
            if layer_type == "lm_head" and head_dense_min_tokens is not None:
                min_tokens = head_dense_min_tokens
            elif layer_type == "lm_head" and dense_min_tokens > 0:
                # the packed int8 head only wins at one row (measured 1.0 vs 1.5 ms; 3.3 vs 1.4 ms at 8 rows)
                min_tokens = min(dense_min_tokens, LM_HEAD_DENSE_MIN_TOKENS)
            own = linear_dtype if linear_dtype is not None and layer_type in ("attn", "mlp") else dtype
            return build_linear(w, bias, device, own, min_tokens, block_ops, dense_dtype)

        self.norm = take_norm("norm")
        self.kv_group = cfg.kv_groups().group  # per layer: its KV group (the metadata it reads, when a list)
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            bias = None
            if cfg.attention_bias:
                bias = pop(p + "qkv_bias") if p + "qkv_bias" in weights else torch.cat(
                    [pop(p + "q_bias"), pop(p + "k_bias"), pop(p + "v_bias")])
            layer = {
                "input_norm": take_norm(p + "input_norm"),
                "post_norm": take_norm(p + "post_norm"),  # before the MLP
                "qkv": linear(p + "qkv", [p + "q", p + "k", p + "v"], "attn", bias),  # (Q+2K, H)
                "o": linear(p + "o", [p + "o"], "attn"),
                "window": cfg.window(i),
            }
            if cfg.num_experts:  # a router (float, small) and per expert its own fused gate/up and down
                router = pop(p + "router")
                layer["router"] = (router if isinstance(router, torch.Tensor) else dequantize(router)).to(
                    device=device, dtype=dtype).contiguous()
                # no dense copies: an expert sees ~k/E of a step's rows, rarely enough for one to pay its memory
                layer["experts"] = [
                    (linear(f"{p}experts.{e}.gate_up", [f"{p}experts.{e}.gate", f"{p}experts.{e}.up"], "mlp",
                            dense=False),
                     linear(f"{p}experts.{e}.down", [f"{p}experts.{e}.down"], "mlp", dense=False))
                    for e in range(cfg.num_experts)]
            else:
                layer["gate_up"] = linear(p + "gate_up", [p + "gate", p + "up"], "mlp")  # (2I, H)
                layer["down"] = linear(p + "down", [p + "down"], "mlp")
            for name in (("q_norm", "k_norm") if cfg.qk_norm else ()) + (
                    ("attn_out_norm", "mlp_out_norm") if cfg.sandwich_norm else ()):
                layer[name] = take_norm(p + name)
            self.layers.append(layer)
        # the embedding table doubles as the LM head when tied; an int8 head then serves lookups as well
        if cfg.tie_word_embeddings:
            table = pop("embed")
            head_src = pop("lm_head") if "lm_head" in weights else table  # a checkpoint may store its own head
            weights["lm_head"] = head_src
            self.lm_head = linear("lm_head", ["lm_head"], "lm_head")
            embed_int8 = quant is not None and quant.embed == "int8"
            if head_src is table and (self.lm_head.kind in ("dense", "q4-block", "q8-block") or (
                    self.lm_head.kind == "int8" and (not isinstance(table, torch.Tensor) or embed_int8))):
                self.embed = self.lm_head
            else:  # lookups from a table of their own (e.g. a quantized head, full-precision embedding)
                if isinstance(table, torch.Tensor) and embed_int8:
                    table = quantize_weight(table.float(), "int8", quant)
                self.embed = build_linear(table, None, device, dtype, block_ops=block_ops)
        else:
            self.lm_head = linear("lm_head", ["lm_head"], "lm_head")
            self.embed = linear("embed", ["embed"], "embed")
        # the full layers' rotary; sliding layers with a base of their own (gemma3) use a second, unscaled one
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, device, dtype,
                                      rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        self.rotary_local = self.rotary
        if cfg.rope_local_theta is not None and "sliding" in cfg.layer_types:
            self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_local_theta, device, dtype)
        if cfg.no_rope_layers:  # cos 1 and sin 0: q and k leave the rotary (and the fused rope + KV write) as they came
            none = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, device, dtype,
                                   torch.zeros(cfg.head_dim // 2))
        for i, layer in enumerate(self.layers):
            layer["rotary"] = none if i in cfg.no_rope_layers else (
                self.rotary_local if layer["window"] else self.rotary)
        # gemma: embeddings times sqrt(hidden), rounded to the model dtype as the reference does
        self.embed_scale = None if cfg.embed_scale is None else torch.tensor(cfg.embed_scale).to(dtype)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        # bfloat16 dense weights on CPU: oneDNN's pre-packed layout (a tied head keeps its rows for lookups)
        for lin in self.linears().values():
            if lin.kind == "dense":
                lin.prepack(keep_weight=lin is self.embed)
        # fused CPU kernels for the small per-layer operations (None: the same math as torch operations)
        self.ops = cpu_ops() if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) else None

    def set_activation_bits(self, bits: int) -> bool:
        """The block kernels' activation precision (``--activation-bits``): 16 (two int8 levels) or 8 (one).
        Returns whether any linear runs the block kernels (else the setting has nothing to act on)."""
        if bits not in (8, 16):
            raise ValueError(f"activation bits must be 8 or 16, got {bits}")
        blocks = [lin for lin in self.linears().values() if hasattr(lin, "act_levels")]
        for lin in blocks:
            lin.act_levels = 1 if bits == 8 else 2
        return bool(blocks)

    def set_large_step_weights(self, min_tokens: int) -> bool:
        """Steps of at least ``min_tokens`` rows run the layers' packed linears on bfloat16 stripes of their
        weights (``BlockQuantLinear._stripes``; 0: never). The LM head keeps its blocks (a step's head computes a
        few rows). Returns whether any linear takes the setting."""
        head = {id(self.lm_head), id(self.embed)}
        lins = [lin for lin in self.linears().values() if hasattr(lin, "bf16_min_tokens") and id(lin) not in head]
        for lin in lins:
            lin.bf16_min_tokens = min_tokens
        return bool(lins)

    def linears(self) -> dict[str, object]:
        out = {"lm_head": self.lm_head, "embed": self.embed}
        for i, layer in enumerate(self.layers):
            for name in ("qkv", "o", "gate_up", "down"):
                if name in layer:
                    out[f"layers.{i}.{name}"] = layer[name]
            for e, (gate_up, down) in enumerate(layer.get("experts", ())):
                out[f"layers.{i}.experts.{e}.gate_up"] = gate_up
                out[f"layers.{i}.experts.{e}.down"] = down
        return out

    def weight_bytes(self) -> int:
        tensors = [self.norm] + [t for lin in self.linears().values() for t in lin.tensors()]
        tensors += [layer[n] for layer in self.layers for n in NORMS if n in layer]
        return tensor_bytes(tensors)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, H). ``meta``: one for all layers, or one per KV
        layer group (``cfg.kv_groups()``), each layer reading its group's."""
        metas = meta if isinstance(meta, list) else [meta] * (max(self.kv_group) + 1)
        if self.ops is not None:
            return self._forward_fused(input_ids, positions, kv_caches, metas)
        return self._forward_torch(input_ids, positions, kv_caches, metas)

    def _attention(self, layer: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: tuple, meta):
        """A layer's attention over the paged KV cache (causal; the layer's window): (T, Hq, D)."""
        return paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, window=layer["window"],
                               softcap=self.cfg.attn_softcap or 0.0)

    def _forward_torch(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, metas: list):
        """The layers with torch operations (the attention: ``_attention``)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        t = input_ids.shape[0]
        h = self._embed(input_ids)  # (T, H)
        rots = {id(layer["rotary"]): layer["rotary"].cos_sin(positions) for layer in self.layers}
        nq, nkv, d = self.num_heads, self.num_kv_heads, cfg.head_dim
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            meta = metas[self.kv_group[i]]
            x = rms_norm(h, layer["input_norm"], eps)
            qkv = layer["qkv"](x)  # (T, Q+2K)
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.reshape(t, nq + nkv, d)
            if cfg.qk_norm:
                qk = torch.cat([rms_norm(qk[:, :nq], layer["q_norm"], eps), rms_norm(qk[:, nq:], layer["k_norm"], eps)],
                               dim=1)
            qk = layer["rotary"].apply(rots[id(layer["rotary"])], qk)  # q and k heads rotated in one pass
            q, k = qk[:, :nq], qk[:, nq:]
            v = v.reshape(t, nkv, d)
            attn = self._attention(layer, q, k, v, (k_cache, v_cache), meta)
            o = self._reduce(layer["o"](attn.reshape(t, self.q_size)))  # row-parallel: partial sums
            h = h + (rms_norm(o, layer["attn_out_norm"], eps) if cfg.sandwich_norm else o)
            x = rms_norm(h, layer["post_norm"], eps)
            m = self._reduce(self._mlp(layer, x))
            h = h + (rms_norm(m, layer["mlp_out_norm"], eps) if cfg.sandwich_norm else m)
        return rms_norm(h, self.norm, eps)

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metas: list[AttentionMetadata]) -> torch.Tensor:
        """The same layers with the fused CPU kernels: the residual add is folded into the next RMSNorm (h is
        updated in place), rotary + the K/V cache write are one pass, decode attention reads blocks in place."""
        cfg, ops, eps = self.cfg, self.ops, self.cfg.rms_norm_eps
        t = input_ids.shape[0]
        nq, nkv, d = self.num_heads, self.num_kv_heads, cfg.head_dim
        h = self._embed(input_ids).contiguous()  # (T, H): the residual stream, added to in place
        x = ops.rms_norm(h, self.layers[0]["input_norm"], eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            meta = metas[self.kv_group[i]]
            qkv = layer["qkv"](x)  # (T, Q+2K)
            if cfg.qk_norm:  # each q and k head normalised in place, before the rotary
                ops.qk_norm(qkv, layer["q_norm"], layer["k_norm"], nq, nkv, eps)
            rot = layer["rotary"]
            ops.rope_write_kv(qkv, positions, rot.cos32, rot.sin32, meta.slot_mapping, k_cache, v_cache, nq, nkv)
            q = qkv[:, : self.q_size].view(t, nq, d)  # rotated in place
            attn = paged_attention(q, None, None, k_cache, v_cache, meta, self.scale, ops,
                                   window=layer["window"], softcap=cfg.attn_softcap or 0.0)  # (T, Hq, D)
            o = self._reduce(layer["o"](attn.reshape(t, self.q_size)))
            if cfg.sandwich_norm:
                o = ops.rms_norm(o, layer["attn_out_norm"], eps)
            x = ops.add_rms_norm(h, o, layer["post_norm"], eps)
            mlp = self._reduce(self._mlp(layer, x))
            if cfg.sandwich_norm:
                mlp = ops.rms_norm(mlp, layer["mlp_out_norm"], eps)
            nxt = self.layers[i + 1]["input_norm"] if i + 1 < len(self.layers) else self.norm
            x = ops.add_rms_norm(h, mlp, nxt, eps)
        return x

    def _gated(self, gate_up, down, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate) * up) with gate and up from one fused projection."""
        if self.ops is not None:
            act_and_mul = self.ops.silu_and_mul if self.cfg.hidden_act == "silu" else self.ops.gelu_tanh_and_mul
            # packed weights' own large-step path (bfloat16 stripes), where they have one
            y = gate_up.gated(x, act_and_mul, down) if hasattr(gate_up, "gated") else None
            if y is not None:
                return y
            # whole where a piece would take gate_up's stripes (each piece would decode every weight again)
            if x.shape[0] <= MLP_ROWS or 0 < getattr(gate_up, "bf16_min_tokens", 0) <= MLP_ROWS:
                return down(act_and_mul(gate_up(x)))
            return torch.cat([down(act_and_mul(gate_up(x[i:i + MLP_ROWS]))) for i in range(0, x.shape[0], MLP_ROWS)])
        gu = gate_up(x)
        gate, up = gu.chunk(2, dim=-1)
        return down(self.act(gate) * up)

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        if "experts" not in layer:
            return self._gated(layer["gate_up"], layer["down"], x)
        # mixture of experts: softmax over the router's logits (float32), the top k per token (renormalised), and
        # the step's tokens grouped per expert, so each chosen expert runs once on all of its tokens; experts are
        # added in ascending order, as the reference does
        probs = torch.softmax(F.linear(x, layer["router"]), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.cfg.num_experts_per_tok, dim=-1)  # (T, k)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            slot, rows = torch.where((chosen == e).T)  # (k, T) order: by slot, then token, as the reference
            y = self._gated(*layer["experts"][e], x[rows].contiguous())
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else self.tp.all_reduce(x)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows; with tensor parallelism each rank looks up the ids in its vocabulary slice (zeros
        elsewhere) and the ranks' rows are summed."""
        h = self._embed_rows(ids)
        return h if self.embed_scale is None else h * self.embed_scale

    def _embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed.embedding(ids)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_per_rank)
        h = self.embed.embedding(torch.where(inside, local, torch.zeros_like(local)))  # (T, H)
        return self.tp.all_reduce(h * inside.unsqueeze(-1).to(h.dtype))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) -> (R, vocab) float32 logits; each rank computes its vocabulary slice, gathered on all ranks."""
        logits = self.lm_head(hidden)
        if self.tp is not None:
            logits = self.tp.all_gather(logits, dim=-1)[:, : self.cfg.vocab_size]
        logits = logits.float()
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
