"""The decoder-only transformer every registered architecture (``model.archs``) assembles, over flat token batches
and a paged KV cache: llama's layers, with the variants an architecture's ``ModelArchConfig`` picks (q/k/v biases,
QK-norm, GeGLU, sandwich norms, scaled embeddings, sliding-window layers with their own rotary base, rotary
scaling, logit soft-capping).

The step's tokens of all sequences are one flat (T, hidden) batch: every linear layer runs once per step for the
whole batch; only attention looks at sequence boundaries (through ``AttentionMetadata``). q/k/v and gate/up
projections are fused into one matmul each. The model is a tree of ``layers`` classes (``DecoderLayer`` holding an
``Attention`` and a ``GatedMLP`` or ``MoE``), each taking its own weights and running one forward over the ops
backend chosen at build time (``layers.ops``: the fused CPU kernels or torch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.layers.attention import Attention, AttentionMetadata, QueryTemperature
from pagedllm.layers.decoder_layer import DecoderLayer
from pagedllm.layers.gated_deltanet import GatedDeltaNet, StateMetadata
from pagedllm.layers.short_conv import ShortConv
from pagedllm.layers.linear import build_linear, tensor_bytes
from pagedllm.layers.mamba2 import Mamba2
from pagedllm.layers.mlp import DenseAndExperts, GatedMLP, MoE
from pagedllm.layers.ops import choose_ops
from pagedllm.layers.per_layer_inputs import PerLayerInput, PerLayerInputs
from pagedllm.layers.rotary import RotaryEmbedding, rope_attention_factor, rope_inv_freq
from pagedllm.layers.weights import LinearBuild, WeightSource
from pagedllm.model.arch import ModelArchConfig, tp_layout
from pagedllm.quant.policy import quantize_weight

# how a decoder layer's weights split over tensor-parallel ranks: what its layer classes declare
TP_SPLIT = Attention.TP_SPLIT | GatedMLP.TP_SPLIT


class CausalLM:
    def __init__(self, cfg: ModelArchConfig, weights: dict, device: torch.device, dtype: torch.dtype,
                 build: LinearBuild | None = None, tp=None, kv_dtype: torch.dtype | None = None,
                 causal: bool = True, shares_with: "CausalLM | None" = None) -> None:
        """Takes (and empties) ``weights``, named as ``model.loader`` names them; the linears are built as ``build``
        says (quantization policy, block kernels, dense copies, activation bits, large steps: the runtime plan's
        choices, ``worker.plan``; None: float weights as stored, quantized ones on torch's kernels).

        ``tp`` (a ``pagedllm.distributed.group.TPGroup``): the weights are this rank's shard
        (``pagedllm.distributed.sharding.shard_weights``); the model keeps its rank's heads, all-reduces after the
        row-parallel ``o``/``down`` and the vocabulary-parallel embedding, and all-gathers the logits. None: the
        whole model in this process. ``kv_dtype``: the dtype of the K/V caches it is run with (default ``dtype``; a
        bfloat16 cache under float32 activations rounds k and v as they are written, and every attention reads
        them back from the cache). ``causal`` False: the layers attend both ways over whole texts (an encoder,
        ``model.encoder.BidirectionalLM``). ``shares_with``: the embedding and LM head are that model's, not
        built from ``weights`` (a multi-token prediction module's, ``model.mtp``)."""
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.tp = tp
        # called between layers when set (the worker's: a data-parallel replica giving back borrowed cores)
        self.between_layers: Callable[[], None] | None = None
        # this rank's share (all of it without tensor parallelism)
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.vocab_start, self.vocab_per_rank = 0, cfg.vocab_size
        if tp is not None:
            lay = tp_layout(cfg, tp.world_size, tp.rank)
            self.num_heads, self.num_kv_heads = lay.num_heads, lay.num_kv_heads
            self.vocab_start, self.vocab_per_rank = lay.vocab_start, lay.vocab_per_rank
        build = build or LinearBuild()
        quant = build.quant
        src = WeightSource(weights, device, dtype, build, cfg.norm_float32)

        # the full layers' rotary; sliding layers with a base of their own (gemma3) use a second, unscaled one
        # partial rotary: the first rot_dim dimensions of each head (Gemma 4's full layers: their own head size)
        rot_dim = cfg.rotary_dim or cfg.global_head_dim or cfg.head_dim
        self.rotary = RotaryEmbedding(rot_dim, cfg.max_position, cfg.rope_theta, device, dtype,
                                      rope_inv_freq(rot_dim, cfg.rope_theta, cfg.rope_scaling),
                                      rope_attention_factor(cfg.rope_scaling))
        rotary_local = self.rotary
        if cfg.rope_local_theta is not None and "sliding" in cfg.layer_types:
            rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_local_theta, device, dtype)
        none = None
        if cfg.no_rope_layers:  # cos 1 and sin 0: q and k leave the rotary (and the fused rope + KV write) as they came
            none = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, device, dtype,
                                   torch.zeros(cfg.head_dim // 2))

        temperature = (QueryTemperature(cfg.attn_temperature_scale, cfg.attn_temperature_length)
                       if cfg.attn_temperature_scale else None)
        self.norm = src.norm("norm")
        self.kv_group = cfg.kv_groups().group  # per layer: its KV group (the metadata it reads, when a list)
        self.state_layers = frozenset(cfg.state_layers())  # layers with a recurrent state (reading the state meta)
        self.layers: list[DecoderLayer] = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            window = cfg.window(i)
            if cfg.has_state(i):  # a state per sequence instead of K/V
                kind = cfg.layer_types[i]
                attn = (GatedDeltaNet.load(src, p, cfg) if kind == "linear" else Mamba2.load(src, p, cfg)
                        if kind == "mamba" else ShortConv.load(src, p))
            else:
                shared = cfg.kv_source(i) != i  # attends over an earlier layer's K/V
                head_dim = cfg.layer_head_dim(i)
                kv_heads = self.num_kv_heads if tp is not None else cfg.layer_kv_heads(i)
                qkv, o = Attention.load_projections(src, p, cfg.attention_bias, cfg.attn_output_gate, head_dim,
                                                    "shared" if shared else "own")
                attn = Attention(qkv, o, self.num_heads, kv_heads, head_dim, self.scale,
                                 none if i in cfg.no_rope_layers else (rotary_local if window else self.rotary),
                                 window, cfg.attn_softcap or 0.0, src.norm(p + "q_norm") if cfg.qk_norm else None,
                                 src.norm(p + "k_norm") if cfg.qk_norm and not shared else None, cfg.rms_norm_eps,
                                 causal, temperature, src.pop(p + "sinks").to(device, torch.float32).contiguous()
                                 if cfg.attn_sinks else None, cfg.attn_output_gate,
                                 torch.ones(head_dim, dtype=src.norm_dtype, device=device) if cfg.attn_v_norm else None,
                                 shared)
            if cfg.moe_beside_mlp:  # Gemma 4's block: a dense MLP and the experts side by side
                mlp = DenseAndExperts.load(src, p, cfg.hidden_act, cfg.num_experts, cfg.num_experts_per_tok,
                                           cfg.rms_norm_eps)
            elif cfg.num_experts and i >= cfg.first_dense_layers:
                mlp = MoE.load(src, p, cfg.hidden_act, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                               cfg.moe_scoring, cfg.moe_routed_scale)
            else:  # (Granite's dense MLP is its "shared" one)
                mlp = GatedMLP.load(src, p + ("shared." if p + "shared.down" in src else ""), cfg.hidden_act)
            sandwich = cfg.sandwich_norm
            self.layers.append(DecoderLayer(
                src.norm(p + "input_norm"), src.norm(p + "post_norm"), attn, mlp, cfg.rms_norm_eps,
                src.norm(p + "attn_out_norm") if sandwich else None, src.norm(p + "mlp_out_norm") if sandwich else None,
                tp, PerLayerInput.load(src, p, cfg.rms_norm_eps) if cfg.per_layer_input_size else None,
                src.norm(p + "layer_scalar") if p + "layer_scalar" in src else None, cfg.residual_scale))
        self.per_layer_inputs = PerLayerInputs.load(src, cfg) if cfg.per_layer_input_size else None
        self.rotaries = list({id(la.attn.rotary): la.attn.rotary for la in self.layers
                              if la.attn.rotary is not None}.values())
        # the embedding table doubles as the LM head when tied; an int8 head then serves lookups as well
        self.shares_with = shares_with
        if shares_with is not None:
            self.embed, self.lm_head = shares_with.embed, shares_with.lm_head
        elif cfg.tie_word_embeddings:
            table = src.pop("embed")
            head_src = src.pop("lm_head") if "lm_head" in src else table  # a checkpoint may store its own head
            weights["lm_head"] = head_src
            self.lm_head = src.linear("lm_head", ["lm_head"], "lm_head")
            embed_int8 = quant is not None and quant.embed == "int8"
            if head_src is table and (self.lm_head.kind in ("dense", "q4-block", "q8-block") or (
                    self.lm_head.kind == "int8" and (not isinstance(table, torch.Tensor) or embed_int8))):
                self.embed = self.lm_head
            else:  # lookups from a table of their own (e.g. a quantized head, full-precision embedding)
                if isinstance(table, torch.Tensor) and embed_int8:
                    table = quantize_weight(table.float(), "int8", quant)
                self.embed = build_linear(table, None, device, dtype, block_ops=build.block_ops)
        else:
            self.lm_head = src.linear("lm_head", ["lm_head"], "lm_head")
            self.embed = src.lookup_table("embed")
        # gemma: embeddings times sqrt(hidden), rounded to the model dtype as the reference does
        self.embed_scale = None if cfg.embed_scale is None else torch.tensor(cfg.embed_scale).to(dtype)
        # bfloat16 dense weights on CPU: oneDNN's pre-packed layout (a tied head keeps its rows for lookups)
        lookups = [self.embed] + ([self.per_layer_inputs.embed] if self.per_layer_inputs is not None else [])
        for lin in self.linears().values():
            if lin.kind == "dense":
                lin.prepack(keep_weight=any(lin is t for t in lookups))
        # the operations between the matmuls: the fused CPU kernels where they run, else torch's (``layers.ops``)
        self.ops = choose_ops(device, dtype)

    def linear_slots(self):
        """(name, owner, attribute) of every linear, named as ``model.loader`` names their weights
        (``layers.{i}.qkv``, ``layers.{i}.experts.{e}.down``, ``lm_head``, ...): what the weight plan, quantization
        and calibration walk (calibration swaps linears in place through them). A model sharing another's
        embedding and head (``shares_with``) lists only its own."""
        if self.shares_with is None:
            yield "lm_head", self, "lm_head"
            yield "embed", self, "embed"
        if self.per_layer_inputs is not None:
            yield from self.per_layer_inputs.linear_slots()
        for i, layer in enumerate(self.layers):
            yield from layer.linear_slots(f"layers.{i}.")

    def linears(self) -> dict[str, object]:
        return {name: getattr(owner, attr) for name, owner, attr in self.linear_slots()}

    def weight_bytes(self) -> int:
        tensors = [self.norm] + [t for lin in self.linears().values() for t in lin.tensors()]
        tensors += [self.per_layer_inputs.norm] if self.per_layer_inputs is not None else []
        tensors += [t for layer in self.layers for t in layer.norms().values()]
        return tensor_bytes(tensors)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata | list[AttentionMetadata],
                state_meta: StateMetadata | None = None, h: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, H). ``meta``: one for all layers, or one per KV
        layer group (``cfg.kv_groups()``), each layer reading its group's; ``state_meta``: the recurrent states'
        slots, which the linear layers (``kv_caches[i]``: their state pools) read (the last entry of the list).
        ``h``: the residual stream's first values (T, H), instead of the tokens' embeddings (taken over)."""
        metas = meta if isinstance(meta, list) else [meta] * (max(self.kv_group) + 1)
        return self._layers(input_ids, positions, kv_caches, metas + [state_meta], h)

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, metas: list,
                h: torch.Tensor | None = None) -> torch.Tensor:
        """The embedding, every layer over ``self.ops`` (the residual stream added to in place, each add folded into
        the next norm), the final norm."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        h = (self._embed(input_ids) if h is None else h).contiguous()  # (T, H): the residual stream
        rots = {id(r): ops.step_rotary(r, positions) for r in self.rotaries}  # looked up once per step
        ple = None if self.per_layer_inputs is None else self.per_layer_inputs(input_ids, h, ops)  # (T, L, size)
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        keep = metas[-1] if self.state_layers and metas[-1] is not None and metas[-1].kept is not None else None
        hook = self.between_layers
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            if hook is not None and i:
                hook()
            nxt = self.layers[i + 1].input_norm if i < last else self.norm
            if keep is not None and i in self.state_layers:  # the state layer's input rows, for a replay
                keep.kept[i] = x[keep.keep_rows]
            x = layer(x, h, positions, rots.get(id(layer.attn.rotary)), kv, metas[self.kv_group[i]], nxt, ops,
                      None if ple is None else ple[:, i])
        return x

    @torch.inference_mode()
    def replay_states(self, kept: dict, state_meta: StateMetadata, kv_caches: list) -> None:
        """Run each state layer's mixer again over its kept input rows (``StateMetadata.kept``) as ``state_meta``
        lays them out, for the states alone (outputs dropped): speculative decoding's rewind to the accepted
        tokens, from the states as they were before the step."""
        for i, x in kept.items():
            self.layers[i].attn(x, None, None, kv_caches[i], state_meta, self.ops)

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
        if self.cfg.logit_scale != 1.0:  # Granite: logits / logits_scaling
            logits = logits / self.cfg.logit_scale
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
