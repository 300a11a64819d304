"""The model runner: the only place that owns the device and its tensors.

It turns a ``SchedulerOutput`` into input tensors (flat tokens, positions, slot mapping, block tables), runs the
model, samples, and returns a ``ModelRunnerOutput`` of plain ints and lists. The parts it orchestrates live
beside it: the KV cache (``worker.kv_cache``), sampling metadata and grammar masks (``sample.metadata``,
``sample.structured``), speculative proposers and draft verification (``spec.proposer``, ``spec.verify``), and
tensor parallelism (``distributed``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import weakref
import zlib
from typing import NamedTuple

import torch

from pagedllm.config import EngineConfig, resolve_model_path, state_slots
from pagedllm.distributed.launcher import join_tensor_parallel, rank_device
from pagedllm.distributed.sharding import check_shardable, shard_weights
from pagedllm.errors import TensorParallelError
from pagedllm.kernels import cpu_ops, kernel_path
from pagedllm.layers.attention import AttentionMetadata, PrefillSeq
from pagedllm.layers.gated_deltanet import StateMetadata, StatePrefill
from pagedllm.model.arch import ModelArchConfig
from pagedllm.model.decoder import TP_SPLIT, CausalLM
from pagedllm.model.encoder import SentenceHead, build_encoder
from pagedllm.model.mtp import MTPHead, pop_mtp_weights
from pagedllm.model.sentence import read_sentence_modules
from pagedllm.outputs import ModelRunnerOutput, SampledTokenLogprobs, SchedulerOutput
from pagedllm.sample.metadata import CachedRequestState, build_sampling_metadata
from pagedllm.sample.sampler import Sampler, gather_logprobs
from pagedllm.sample.structured import StructuredOutputs, grammar_masks, sync_matcher
from pagedllm.spec.proposer import DraftProposer, MTPProposer, NgramProposer, Proposer, TargetStep, load_draft_model
from pagedllm.spec.verify import accept_greedy, verify_random
from pagedllm.worker.autotune import plan_summary
from pagedllm.worker.core_share import CoreShare
from pagedllm.worker.heap import keep_freed_memory
from pagedllm.worker.kv_cache import KVCache
from pagedllm.worker.plan import BF16_STEP_MIN_TOKENS, DTYPES, choose_device, load_and_plan
from pagedllm.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

# prefill chunks with at most this much context run through the fused row kernel (see ``_step_tensors``)
# (up to this context the row kernel is at least as fast as the tiled matmuls, and much faster for many short
# prompts, which it takes without a per-sequence gather: docs/history.md)
ROW_KERNEL_MAX_CONTEXT = 2048


# prompt logprobs: logits are computed this many rows at a time (a 2048-token chunk of a 150k vocabulary at once
# would take 1.2 GB)
PROMPT_LOGIT_ROWS = 256
# an encoder's step rows padded to a multiple of this (``_forward_step``): oneDNN's GEMMs are built per row count
# (kept in its cache) and run fastest at multiples of their blocks; 64 rows are ~3% of a 2048-token step
ENCODER_ROW_ALIGN = 64


class _Forward(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    hidden: torch.Tensor  # (rows, hidden) after the final norm
    logits: torch.Tensor | None  # (rows to sample, vocab) float32
    prompt_logprobs: list[SampledTokenLogprobs] | None  # rank 0: per prompt row (``StepInputs.prompt_rows``)
    rewind: tuple | None = None  # drafts verified on a hybrid: (states before the step, state layers' input rows)


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, store=None) -> None:
        """With ``tensor_parallel_size`` > 1, rank 0 (the engine's runner) starts or joins the other ranks and
        holds its shard of the weights and KV cache; a runner with ``rank`` > 0 is a worker's, driven by
        ``serve_steps`` (``store``: a local worker's rendezvous store)."""
        self.config = config
        self.rank = rank
        self.tp = None  # a TPGroup when tensor_parallel_size > 1
        # a replica of --data-parallel-size that borrows its idle siblings' cores for its steps
        self.core_share = (CoreShare(config.parallel.core_share_file) if config.parallel.core_share_file
                           and config.tensor_parallel_size == 1 else None)
        self.tp_workers = None  # rank 0's local worker processes (LocalWorkers), when it started them
        self.rank_weight_bytes: list[int] = []  # weight bytes held by each rank (tensor parallelism)
        self.device = choose_device(config.device)
        if config.tensor_parallel_size > 1:
            self.device = rank_device(self.device, rank)
        path = resolve_model_path(config.model.model)
        self.model_path = path
        ops = cpu_ops() if self.device.type == "cpu" else None
        self.kernel_path = kernel_path() if self.device.type == "cpu" else f"torch on {self.device}"
        # every speed choice, made before the model is built (``worker.plan``)
        arch, weights, self.plan = load_and_plan(config, path, self.device, ops)
        plan = self.plan
        self.dtype, self.kv_dtype, self.quantization = plan.dtype, plan.kv_dtype, plan.quantization
        self.arch: ModelArchConfig = arch
        # an embedding model's sentence-transformers modules: its pooling, Dense layers, prompts and length
        self.sentence = read_sentence_modules(path)
        if self.sentence is not None:
            arch = self.arch = dataclasses.replace(arch, pooling=self.sentence.pooling)
        # a multi-token prediction module's tensors (Qwen 3.5 checkpoints): kept for MTP speculation, else dropped
        mtp_weights = pop_mtp_weights(weights)
        if config.tensor_parallel_size > 1:
            weights = self._start_tensor_parallel(arch, weights, store)
        pool_dense = [weights.pop(k) for k in sorted(k for k in weights if k.startswith("pool_dense."))]  # GGUF's
        self.pool_head = SentenceHead(self.sentence, self.device, pool_dense) if self.sentence or pool_dense else None
        if arch.encoder:
            if config.tensor_parallel_size > 1 or config.speculative is not None:
                raise ValueError("an embedding (encoder) model runs without tensor parallelism or speculation")
            self.model = build_encoder(arch, weights, self.device, self.dtype, plan.build)
        else:
            self.model = CausalLM(arch, weights, self.device, self.dtype, plan.build, tp=self.tp,
                                  kv_dtype=self.kv_dtype)
        del weights
        max_len = config.model.max_model_len or arch.max_position
        if arch.encoder and not config.model.max_model_len and self.sentence and self.sentence.max_seq_length:
            max_len = min(max_len, self.sentence.max_seq_length)  # the length it was trained on (its modules')
        if max_len > arch.max_position:
            raise ValueError(
                f"max_model_len ({max_len}) is larger than the model's context length ({arch.max_position})"
            )
        self.max_model_len = max_len
        self.block_size = config.cache.block_size
        self.draft_model: CausalLM | None = None
        spec = config.speculative
        if spec is not None and spec.method == "draft_model" and rank == 0:
            # with tensor parallelism: whole, on rank 0 only
            self.draft_model = load_draft_model(spec.model, arch, max_len, self.device, self.dtype, self.kv_dtype)
        if self.draft_model is not None and self.draft_model.cfg.hybrid_state:
            raise ValueError(f"the draft model ({self.draft_model.cfg.arch}) has recurrent-state layers: a draft "
                             "model's states are not rewound after rejected tokens (use ngram speculation, or an "
                             "attention-only draft model)")
        self.mtp: MTPHead | None = None
        if spec is not None and spec.method == "mtp" and rank == 0:
            if not mtp_weights:
                raise ValueError(f"{path} has no multi-token prediction module (mtp.* tensors) for speculative method "
                                 "'mtp': Qwen 3.5's HF checkpoints ship one; llama.cpp's GGUF converter leaves it out")
            self.mtp = MTPHead(self.model, mtp_weights, plan.build)
        del mtp_weights
        # a draft model's or the MTP module's layers get their KV in the same blocks
        self.kv = KVCache(config.cache, self.model, self.draft_model or (self.mtp and self.mtp.model), self.device,
                          self.kv_dtype)
        # a hybrid model: a recurrent state per running sequence, and (prefix caching) more that keep prefix
        # snapshots while free (``config.state_slots``); on CPU beside the KV budget, committed as they are used
        self.num_state_slots = self.state_live_slots = 0  # (live: the slots running requests may claim)
        if arch.hybrid_state:
            self.num_state_slots, self.state_live_slots = state_slots(
                self.kv.state_bytes_per_slot, config.scheduler.max_num_seqs, config.cache.enable_prefix_caching)
        num_blocks = self.kv.budget_blocks(self.num_state_slots * self.kv.state_bytes_per_slot)
        if self.tp is not None:
            num_blocks = self._tp_agree(num_blocks)
        self.kv.allocate(num_blocks, self.max_model_len, self.num_state_slots)
        self.proposer: Proposer | None = None  # rank 0's speculative proposer
        if spec is not None and rank == 0:
            # the draft's decode metadata as the runner builds it (a partial: no reference to the runner)
            meta = functools.partial(_decode_metadata, bs=self.block_size, dev=self.device,
                                     with_mask=not self.model.ops.fused)
            if self.draft_model is not None:
                self.proposer = DraftProposer(spec, max_len, self.draft_model, self.kv.draft_kv_caches,
                                              self.block_size, self.device, meta)
            elif self.mtp is not None:
                self.proposer = MTPProposer(spec, max_len, self.mtp, self.kv.draft_kv_caches, self.block_size,
                                            self.device, meta)
            else:
                self.proposer = NgramProposer(spec, max_len)
        self.sampler = Sampler(ops)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.structured: StructuredOutputs | None = None  # set by the engine (it owns the tokenizer)
        self.requests: dict[str, CachedRequestState] = {}
        logger.info(
            "model %s (%s, %d layers) on %s/%s, weights %s (%.1f MiB), %s; KV cache %d blocks x %d tokens in %s "
            "(%.1f MiB)", path, arch.arch, arch.num_layers, self.device, self.dtype, self.quantization,
            self.model.weight_bytes() / 2**20, self.kernel_path, self.num_blocks, self.block_size,
            str(self.kv_dtype).removeprefix("torch."), self.kv_cache_bytes / 2**20,
        )
        if self.mtp is not None:
            logger.info("speculative decoding with the model's MTP layer (%.1f MiB besides the shared embedding and "
                        "head), %d drafts a step", self.mtp.weight_bytes() / 2**20, spec.num_speculative_tokens)
        if self.num_state_slots:
            logger.info("recurrent states (%d linear layers): %d slots x %.1f MiB, beside the KV cache, committed as "
                        "used (at most %d sequences at once)", len(self.kv.state_layers), self.num_state_slots,
                        self.kv.state_bytes_per_slot / 2**20, self.num_state_slots)
        if plan.activation_bits is not None:
            logger.info("activations: %d-bit per block of 32 (%s)", plan.activation_bits,
                        plan.reasons["activation_bits"])
        if plan.large_step_weights is not None:
            big = plan.build.large_step_min_tokens or BF16_STEP_MIN_TOKENS
            logger.info("steps of %d+ rows: %s (%s)", big, "bfloat16 weight stripes" if
                        plan.large_step_weights == "bf16" else "the block kernels", plan.reasons["large_step_weights"])
            for bits, rows in sorted(plan.build.mid_step_min_rows.items()):
                logger.info("steps of %d-%d rows, %d-bit codes: the kernels' bfloat16 tiles (AMX-BF16, the same "
                            "numerics as the stripes)", rows, big - 1, bits)
        if self.tp is not None and rank == 0:
            logger.info("tensor parallelism: %d ranks, weights per rank %s MiB (%.1f MiB in all), KV cache per rank "
                        "%d heads of %d", self.tp.world_size,
                        " / ".join(f"{b / 2**20:.1f}" for b in self.rank_weight_bytes),
                        sum(self.rank_weight_bytes) / 2**20, self.model.num_kv_heads, arch.num_kv_heads)
        if self.core_share is not None:
            if isinstance(self.model, CausalLM):
                self.model.between_layers = self.core_share.give_back
            self.core_share.end_step()  # loaded: idle until its first step
            logger.info("data parallelism: this replica runs on %d thread(s) of its own, and on the cores of the "
                        "replicas that are idle (%s)", self.core_share.own, os.path.dirname(self.core_share.path))

    def describe(self) -> dict:
        """What runs: device, dtype, weight format, kernel path and the auto-chosen plan (logs, /health)."""
        p = self.plan
        d = {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
             "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
             "weights": self.quantization, "kernels": self.kernel_path}
        if p.build.linear_dtype is not None:  # an encoder's linears in their own dtype
            d["linear_dtype"] = str(p.build.linear_dtype).removeprefix("torch.")
        if p.activation_bits is not None:  # the block kernels run
            d["activation_bits"] = p.activation_bits
        if p.large_step_weights is not None:
            d["large_step_weights"] = p.large_step_weights
        if p.build.mid_step_min_rows:  # code bits -> steps from this many rows (below the large ones) on bf16 tiles
            d["bf16_tile_min_rows"] = {str(b): r for b, r in sorted(p.build.mid_step_min_rows.items())}
            d["large_step_min_rows"] = p.build.large_step_min_tokens
        d["why"] = {k: v for k, v in p.reasons.items() if k in d}
        if p.weight_plan is not None:
            d["weight_plan"] = plan_summary(p.weight_plan)
        if self.core_share is not None:  # the live counts (the dict itself: /health shows them as they are)
            d["data_parallel_cores"] = self.core_share.stats
        return d

    # ------------------------------------------------------------------ KV cache
    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block across its layers (the draft model's layers included)."""
        return self.kv.bytes_per_block

    @property
    def kv_group_windows(self) -> tuple[int, ...]:
        """Per KV layer group, its sliding window (0: full attention): the block tables the scheduler keeps."""
        return self.kv.groups.windows

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv.kv_cache_bytes

    @property
    def num_host_blocks(self) -> int:
        return self.kv.num_host_blocks

    @property
    def num_host_state_slots(self) -> int:
        return self.kv.num_host_state_slots

    # ------------------------------------------------------------------ tensor parallelism
    def _start_tensor_parallel(self, arch: ModelArchConfig, weights: dict, store) -> dict:
        """Check the model splits (before any worker starts), join the ranks, and keep this rank's shard."""
        check_shardable(arch, weights, self.config.tensor_parallel_size)
        self.tp, self.tp_workers = join_tensor_parallel(self.config, self.rank, self.device, store)
        self._tp_finalizer = weakref.finalize(self, _close_tensor_parallel, self.tp, self.tp_workers)
        return shard_weights(arch, weights, self.rank, self.tp.world_size, TP_SPLIT)

    def _tp_agree(self, num_blocks: int) -> int:
        """Start-up agreement of the ranks: the same model and settings everywhere (a hand-started rank may have
        been given other flags), and a KV block count every rank can hold. Collects each rank's weight bytes."""
        a, c = self.arch, self.config.cache
        settings = [a.vocab_size, a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim,
                    a.intermediate_size, self.block_size, list(DTYPES.values()).index(self.dtype),
                    list(DTYPES.values()).index(self.kv_dtype), zlib.crc32(str(self.quantization).encode()),
                    int(c.preemption_mode == "swap"), int(c.swap_space * 2**30), c.num_host_blocks_override or 0]
        rows = self.tp.gather_ints(settings + [num_blocks, self.model.weight_bytes()])
        for r, row in enumerate(rows):
            if row[: len(settings)] != rows[0][: len(settings)]:
                raise ValueError(
                    f"tensor-parallel rank {r} loaded another model or settings than rank 0 ([vocab, hidden, layers, "
                    f"heads, kv heads, head dim, intermediate, block size, dtype, KV dtype, quantization, swap, "
                    f"swap bytes, host blocks] {row[: len(settings)]} vs {rows[0][: len(settings)]}): start every rank with "
                    f"the same model and engine flags")
        self.rank_weight_bytes = [row[-1] for row in rows]
        return min(row[-2] for row in rows)

    def serve_steps(self) -> None:
        """Ranks > 0: run each step rank 0 sends until it shuts the group down."""
        while (packed := self.tp.recv()) is not None:
            self._forward_step(StepInputs.unpack(packed))

    def inject_forward_fault(self, token_id: int | None) -> None:
        """Fault injection for reliability tests (``serve --fault-injection``): this runner's forward steps are
        wrapped so that each one whose batch holds ``token_id`` raises, as a failing kernel would (the engine then
        isolates the request that carries it); None unwraps them. Nothing is checked on the normal path."""
        self.__dict__.pop("_forward_step", None)  # the class's own method again
        if token_id is None:
            return
        forward = self._forward_step

        def faulty_forward_step(step: StepInputs, *args, **kwargs):
            if token_id in step.input_ids:
                raise RuntimeError(f"injected fault: token {token_id} in the forward pass's batch")
            return forward(step, *args, **kwargs)

        self._forward_step = faulty_forward_step

    def went_idle(self) -> None:
        """The engine has no request left (until the next one arrives): a data-parallel replica lends its cores
        at once rather than after ``core_share.IDLE_AFTER_S``."""
        if self.core_share is not None:
            self.core_share.went_idle()

    def shutdown(self) -> None:
        """Rank 0 tells the other ranks to stop and waits for its local workers; any rank leaves the group. A
        data-parallel replica lends its cores from now on. Otherwise there is nothing to do."""
        if self.tp is not None:
            self._tp_finalizer()
        if self.core_share is not None:
            self.core_share.close()
            self.core_share = None

    # ------------------------------------------------------------------ one step
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for nr in so.new_requests:
            sp = nr.sampling_params
            gen = None
            if sp.seed is not None and not sp.greedy:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(sp.seed % (2**63))
            self.requests[nr.req_id] = CachedRequestState(nr.req_id, nr.prompt_token_ids, sp, gen)
        if so.is_empty and not so.has_swaps:
            return ModelRunnerOutput()
        if self.core_share is None:
            return self._execute(so)
        self.core_share.begin_step()  # its own cores and the idle replicas'
        try:
            return self._execute(so)
        finally:
            self.core_share.end_step()

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        step, groups = StepInputs.from_scheduler_output(so, self.block_size)
        verify = self._verified_states(so) if self.num_state_slots else []
        fwd = self._run_step(step, self._prompt_targets(groups.prompt), verify)
        out = ModelRunnerOutput()
        if fwd is None:  # KV swaps only
            return out
        if groups.sample:
            self._sample(so, fwd.logits, groups.sample, out)
        if fwd.rewind is not None:
            self._rewind_states(verify, fwd.rewind, out.sampled_token_ids)
        for s, first, n in groups.prompt:
            out.prompt_logprobs[s.req_id] = fwd.prompt_logprobs[first : first + n]
        for s, first, n in groups.pool:
            self._pool(s, fwd.hidden[first : first + n], out)
        if self.proposer is not None:
            self.proposer.observe(TargetStep(fwd.input_ids, fwd.positions, fwd.meta, fwd.hidden, so.scheduled,
                                             out.sampled_token_ids), self.requests)
        if so.speculate and out.sampled_token_ids:
            out.spec_token_ids = self.proposer.propose(so, out.sampled_token_ids, self.requests,
                                                       self.structured)
        return out

    @staticmethod
    def _verified_states(so: SchedulerOutput) -> list[tuple[str, int, int, int, int]]:
        """A hybrid model's sequences that verify drafts this step: (request, state slot, first row, rows, drafts).
        Their states advance over every draft; after a rejection they are rewound (``_rewind_states``)."""
        out, start = [], 0
        for s in so.scheduled:
            if s.num_spec_tokens and s.state_slot >= 0:
                out.append((s.req_id, s.state_slot, start, len(s.token_ids), s.num_spec_tokens))
            start += len(s.token_ids)
        return out

    def _rewind_states(self, verify: list, rewind: tuple, sampled: dict[str, list[int]]) -> None:
        """After a verify step: each sequence that rejected drafts gets the states it had before the step back,
        then its state layers run again over the rows of its accepted tokens (their inputs kept by the forward
        pass), so that its states end after its last accepted token, as its KV cache does."""
        saved, kept = rewind
        redo, offset = [], 0  # (index in verify, its rows' offset in the kept rows, rows to keep)
        for j, (rid, _, _, n, k) in enumerate(verify):
            new = sampled.get(rid)
            valid = n - k + (len(new) - 1 if new else 0)  # the rows before the drafts, then the accepted drafts
            if valid < n:
                redo.append((j, offset, valid))
            offset += n
        if not redo:
            return
        dev = self.device
        idx = torch.tensor([j for j, _, _ in redo], device=dev)
        slots = torch.tensor([verify[j][1] for j, _, _ in redo], dtype=torch.long, device=dev)
        self.kv.put_state_rows(saved, idx, slots)
        rows = torch.cat([torch.arange(o, o + v) for _, o, v in redo]).to(dev)
        prefills, start = [], 0
        for (_, _, v), slot in zip(redo, slots.tolist()):
            prefills.append(StatePrefill(start, start + v, slot))
            start += v
        meta = self._state_meta([], [], prefills)
        self.model.replay_states({i: x[rows] for i, x in kept.items()}, meta, self.kv.kv_caches)

    def _prompt_targets(self, prompt_groups: list[tuple]) -> tuple[list[int], list[int]]:
        """Per prompt row of the step: the prompt token whose logprob it gives, and how many top alternatives
        its request wants."""
        targets, ks = [], []
        for s, _, n in prompt_groups:
            st = self.requests[s.req_id]
            lo = s.prompt_logprob_span[0]
            targets.extend(st.prompt_token_ids[lo + 1 : lo + 1 + n])
            ks.extend([st.sampling_params.prompt_logprobs] * n)
        return targets, ks

    def _pool(self, s, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """An embedding request's chunk: mean pooling sums its rows, cls pooling keeps the first; its last chunk
        returns the vector."""
        st = self.requests[s.req_id]
        h = hidden.float()
        how = st.sampling_params.pooling
        if how == "mean":
            part = h.sum(dim=0)
            st.pool_sum = part if s.num_computed_tokens == 0 or st.pool_sum is None else st.pool_sum + part
        elif how == "cls" and s.num_computed_tokens == 0:
            st.pool_sum = h[0]
        if s.sample:
            if how == "last":
                vec = h[-1]
            elif how == "mean":
                vec = st.pool_sum / (s.num_computed_tokens + len(s.token_ids))
            else:
                vec = st.pool_sum
            if self.pool_head is not None:
                vec = self.pool_head(vec)
            out.pooled[s.req_id] = vec.tolist()

    def _run_step(self, step: StepInputs, prompt_targets=None, verify=()) -> _Forward | None:
        """Rank 0's part of a step that every rank runs. With tensor parallelism rank 0 first hands the step to
        the other ranks; a failure after that leaves the ranks out of step, so it is fatal for the engine."""
        if self.tp is None:
            return self._forward_step(step, prompt_targets, verify)
        self.tp.check()
        try:
            self.tp.send_step(step.pack())
            return self._forward_step(step, prompt_targets, verify)
        except TensorParallelError:
            raise
        except Exception as e:
            msg = f"rank 0 failed inside a tensor-parallel step ({type(e).__name__}: {e}); the ranks are out of step"
            self.tp.fail(msg)
            raise TensorParallelError(msg) from e

    def _forward_step(self, step: StepInputs, prompt_targets=None, verify=()) -> _Forward | None:
        """What every rank runs for a step: KV block swaps, the forward pass, the logits of the rows to sample
        and of the prompt rows (rank 0, which has ``prompt_targets``, turns those into prompt logprobs)."""
        if step.swap_out or step.swap_in or step.state_swap_out or step.state_swap_in:
            self.kv.swap(step.swap_out, step.swap_in, step.state_swap_out, step.state_swap_in)
        if not step.input_ids:
            return None
        if self.arch.encoder:  # whole texts, nothing cached: each prompt is a span of the flat batch
            spans = sorted([(a, b) for a, b, _ in step.prefills] + [(r, r + 1) for r in step.decode_rows])
            # the rows padded to a multiple of ENCODER_ROW_ALIGN by one more "text" of token 0 at position 0
            # (computed, then dropped): oneDNN builds a GEMM for each new row count (~12 ms a shape here, against
            # ~1.2 ms to run one of a 2000-row step's linears) and runs counts off its blocks slower, so a server's
            # steps, each with its own total of tokens, spent more time building GEMMs than running them
            t = len(step.input_ids)
            pad = -t % ENCODER_ROW_ALIGN
            ids = torch.tensor(step.input_ids + [0] * pad, dtype=torch.long, device=self.device)
            pos = torch.tensor(step.positions + [0] * pad, dtype=torch.long, device=self.device)
            hidden = self.model.forward(ids, pos, spans + ([(t, t + pad)] if pad else []))[:t]
            return _Forward(ids[:t], pos[:t], None, hidden, None, None)
        input_ids, positions, meta, rows = self._step_tensors(step)
        state_meta = rewind = None
        if self.num_state_slots:  # restored snapshots first: a slot zeroed now may have been one
            self.kv.copy_states(step.state_copies)
            self.kv.reset_states(step.fresh_states)
            state_meta = self._state_metadata(step)
            if verify:  # drafts to verify: their states as they are now, and their rows' inputs to each state layer
                dev = self.device
                saved = self.kv.state_rows(torch.tensor([v[1] for v in verify], dtype=torch.long, device=dev))
                state_meta.keep_rows = torch.cat([torch.arange(v[2], v[2] + v[3]) for v in verify]).to(dev)
                state_meta.kept = {}
                rewind = (saved, state_meta.kept)
        hidden = self.model.forward(input_ids, positions, self.kv.kv_caches, meta, state_meta)
        logits = self.model.compute_logits(hidden[rows]) if step.logit_rows else None
        prompt_lps = self._prompt_logprobs(hidden, step.prompt_rows, prompt_targets) if step.prompt_rows else None
        return _Forward(input_ids, positions, meta, hidden, logits, prompt_lps, rewind)

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: list[int], targets) -> list[SampledTokenLogprobs] | None:
        """Raw logprobs (no sampling settings applied, as vLLM's prompt logprobs) of each row's target token,
        its rank and the top alternatives; in slices of ``PROMPT_LOGIT_ROWS`` rows. Every rank computes the
        logits (with tensor parallelism they are gathered across ranks); ranks without targets keep nothing."""
        out = [] if targets is not None else None
        for i in range(0, len(rows), PROMPT_LOGIT_ROWS):
            idx = rows[i : i + PROMPT_LOGIT_ROWS]
            lp = torch.log_softmax(self.model.compute_logits(hidden[torch.tensor(idx, device=hidden.device)]), dim=-1)
            if out is None:
                continue
            toks, ks = targets[0][i : i + len(idx)], targets[1][i : i + len(idx)]
            chosen, ranks, top_i, top_v = gather_logprobs(lp, list(range(len(idx))), toks, max(ks))
            for j, k in enumerate(ks):
                top = list(zip(top_i[j][:k], top_v[j][:k])) if k else []
                out.append(SampledTokenLogprobs(toks[j], chosen[j], ranks[j], top))
        return out

    def _sample(self, so: SchedulerOutput, logits: torch.Tensor, groups, out: ModelRunnerOutput) -> None:
        """Sample every request that reached the end of its tokens; verify its drafts if it had any.

        A request with k drafts has k+1 rows: the target's distribution after its last token and after each
        draft. Penalties and min_tokens at row i see the drafts before it as output tokens."""
        vstates, vextra = [], []
        for s, first, n in groups:
            st = self.requests[s.req_id]
            del st.output_token_ids[s.num_output_tokens :]  # keep in step with the scheduler's view
            spec = s.spec_token_ids
            for i in range(n):
                vstates.append(st)
                vextra.append(spec[:i])
        vocab = logits.shape[1]
        smeta = build_sampling_metadata(vstates, vextra, vocab, self.arch.eos_token_id, self.device)
        smeta.allowed = grammar_masks(groups, self.requests, self.structured, vocab, self.device)
        random_spec = [g for g in groups if g[0].num_spec_tokens and self.requests[g[0].req_id].sampling_params.temperature > 0]
        res = self.sampler(logits, smeta, return_probs=bool(random_spec))
        tokens = res.token_ids.tolist()
        new_tokens = accept_greedy(groups, tokens, self.requests)
        if random_spec:
            new_tokens.update(verify_random(random_spec, res.probs, self.requests))
        lp_rows, lp_toks, lp_owner = [], [], []
        for s, first, n in groups:
            st = self.requests[s.req_id]
            new = new_tokens[s.req_id]
            st.output_token_ids.extend(new)
            if st.sampling_params.structured_outputs is not None:
                sync_matcher(st, self.structured)
            out.sampled_token_ids[s.req_id] = new
            if st.sampling_params.logprobs is not None:
                for i, t in enumerate(new):
                    lp_rows.append(first + i)
                    lp_toks.append(t)
                    lp_owner.append(s.req_id)
        if lp_rows:
            k = smeta.max_num_logprobs or 0
            chosen, ranks, top_i, top_v = gather_logprobs(res.raw_logprobs, lp_rows, lp_toks, k)
            for j, rid in enumerate(lp_owner):
                want = self.requests[rid].sampling_params.logprobs
                top = list(zip(top_i[j][:want], top_v[j][:want])) if want and top_i is not None else []
                out.logprobs.setdefault(rid, []).append(SampledTokenLogprobs(lp_toks[j], chosen[j], ranks[j], top))

    def _step_tensors(self, step: StepInputs):
        """The step's lists as device tensors: token ids, positions, attention metadata, logit rows.

        With the fused CPU kernels, the query rows of short prefill chunks (context up to
        ``ROW_KERNEL_MAX_CONTEXT``) join the decode rows: each row attends over its own context length, so one
        kernel call covers them all (no per-sequence gather); longer chunks use the tiled attention's matmuls."""
        metas = [self._group_metadata(step, g) for g in range(step.num_groups)]
        dev = self.device
        return (
            torch.tensor(step.input_ids, dtype=torch.long, device=dev),
            torch.tensor(step.positions, dtype=torch.long, device=dev),
            metas[0] if len(metas) == 1 else metas,  # a list: one per KV layer group
            torch.tensor(step.logit_rows, dtype=torch.long, device=dev),
        )

    def _state_metadata(self, step: StepInputs) -> StateMetadata:
        """Which state slot each sequence of the step reads and writes (the linear layers')."""
        return self._state_meta(step.decode_rows, step.decode_states, [
            StatePrefill(a, b, slot, n, save) for (a, b, _), slot, n, save in zip(
                step.prefills, step.prefill_states, step.prefill_save_rows, step.prefill_save_slots)],
            len(step.input_ids))

    def _state_meta(self, rows: list[int], slots: list[int], prefills: list[StatePrefill],
                    num_rows: int = -1) -> StateMetadata:
        """The state layers' metadata: one-row sequences at ``rows`` (their ``slots``), then ``prefills``."""
        dev = self.device
        meta = StateMetadata(
            decode_rows=None if rows == list(range(num_rows)) else torch.tensor(rows, dtype=torch.long, device=dev),
            decode_slots=torch.tensor(slots, dtype=torch.long, device=dev), num_decodes=len(rows), prefills=prefills)
        if self.model.ops.fused:
            seqs = [[r, 1, s, 0, -1] for r, s in zip(rows, slots)]
            seqs += [[p.start, p.end - p.start, p.slot, p.save_rows, p.save_slot] for p in prefills]
            meta.seqs = torch.tensor(seqs, dtype=torch.long, device=dev).view(-1, 5)
        return meta

    def _group_metadata(self, step: StepInputs, g: int) -> AttentionMetadata:
        """The attention metadata of KV layer group ``g`` (its slots and block tables; rows and lengths are the
        step's)."""
        dev = self.device
        slots, decode_tables, prefill_tables = step.group(g)
        rows, tables, lens = list(step.decode_rows), list(decode_tables), list(step.decode_lens)
        repeats = [1] * len(tables)  # rows of each table (a prefill chunk's rows share their sequence's)
        prefills = []
        for (start, end, ctx), table in zip(step.prefills, prefill_tables):
            if self.model.ops.fused and ctx <= ROW_KERNEL_MAX_CONTEXT:
                rows.extend(range(start, end))
                tables.append(table)
                repeats.append(end - start)
                lens.extend(range(ctx - (end - start) + 1, ctx + 1))
            else:
                prefills.append(PrefillSeq(start, end, ctx, torch.tensor(table, dtype=torch.long, device=dev)))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decode_rows=None, decode_block_tables=None, decode_mask=None,
            num_decodes=len(rows), prefills=prefills,
        )
        if rows:
            dm = _decode_metadata([], tables, lens, self.block_size, dev, not self.model.ops.fused,
                                  None if len(tables) == len(rows) else repeats)
            meta.decode_block_tables, meta.decode_mask, meta.decode_lens = dm.decode_block_tables, dm.decode_mask, dm.decode_lens
            if rows != list(range(len(step.input_ids))):  # None: every row, in order
                meta.decode_rows = torch.tensor(rows, dtype=torch.long, device=dev)
        return meta


def _decode_metadata(slots: list[int], tables: list[list[int]], lens: list[int], bs: int, dev: torch.device,
                     with_mask: bool, repeats: list[int] | None = None) -> AttentionMetadata:
    """Attention metadata of a batch of decode rows: padded block tables, context lengths and (``with_mask``:
    without the fused kernel, which stops at each row's length, SDPA needs it) the key mask. ``repeats``: how many
    consecutive rows use each of ``tables`` (None: one each); a 2048-row prefill chunk's table is then padded
    once and repeated in torch, not copied per row in Python (12.8 ms a step for 64 blocks)."""
    max_blocks = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
    if repeats is not None:
        padded = padded.repeat_interleave(torch.tensor(repeats), dim=0)
    lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
    mask = None
    if with_mask:
        mask = (torch.arange(max_blocks * bs, device=dev)[None, :] < lens_t[:, None])[:, None, None, :]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        decode_rows=None,
        decode_block_tables=padded.to(dev),
        decode_mask=mask, num_decodes=len(slots), prefills=[], decode_lens=lens_t,
    )


def _close_tensor_parallel(tp, workers) -> None:
    """Leave the group (rank 0 first sends the shutdown message); later steps raise. Runs once: on ``shutdown``,
    when the runner is collected, or at exit."""
    if workers is not None:
        workers.stop_watching()
    clean = tp.failure is None
    if tp.rank == 0:
        tp.shutdown_workers()
    if workers is not None:
        workers.stop(timeout_s=10.0 if clean else 0.5)  # after a failure, nobody is listening: end them
    if tp.failure is None:
        tp.failure = "the tensor-parallel group was shut down"
    tp.close()
