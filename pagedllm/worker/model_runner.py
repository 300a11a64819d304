"""The model runner: the only place that owns the device and its tensors.

It turns a ``SchedulerOutput`` into input tensors (flat tokens, positions, slot mapping, block tables), runs the
model, samples, and returns a ``ModelRunnerOutput`` of plain ints and lists.
"""

from __future__ import annotations

import logging
import math
import weakref
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from pagedllm.config import EngineConfig, resolve_model_path
from pagedllm.errors import TensorParallelError
from pagedllm.kernels import cpu_ops, kernel_path
from pagedllm.layers.attention import AttentionMetadata, PrefillSeq
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import ModelArchConfig, load_model_files
from pagedllm.quant.load import load_weights
from pagedllm.outputs import ModelRunnerOutput, SampledTokenLogprobs, SchedulerOutput
from pagedllm.sample.rejection_sampler import rejection_sample
from pagedllm.sample.sampler import Sampler, SamplingMetadata, gather_logprobs
from pagedllm.sample.structured import StructuredOutputs, fill_bitmasks, unpack_bitmasks
from pagedllm.spec.ngram import propose_ngram
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.autotune import WeightPlan, blocks_for_autotune, choose_plan, plan_summary
from pagedllm.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# prefill chunks with at most this much context run through the fused row kernel (see ``_step_tensors``)
ROW_KERNEL_MAX_CONTEXT = 2048  # measured: 1 x 2000 tokens costs the same both ways; 32 x 180 is 4.6x faster here
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def choose_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    return torch.device(requested)


def choose_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[requested]


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    matcher: object | None = None  # llguidance matcher of a constrained request, fed output_token_ids[:consumed]
    consumed: int = 0


class _Forward(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits: torch.Tensor | None  # (rows to sample, vocab) float32


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, store=None) -> None:
        """With ``tensor_parallel_size`` > 1, rank 0 (the engine's runner) starts or joins the other ranks and
        holds its shard of the weights and KV cache; a runner with ``rank`` > 0 is a worker's, driven by
        ``serve_steps`` (``store``: a local worker's rendezvous store)."""
        self.config = config
        self.rank = rank
        self._fail_token: int | None = None  # fault injection (reliability tests): see inject_forward_fault
        self.tp = None  # a TPGroup when tensor_parallel_size > 1
        self.tp_workers = None  # rank 0's local worker processes (LocalWorkers), when it started them
        self.rank_weight_bytes: list[int] = []  # weight bytes held by each rank (tensor parallelism)
        self.device = choose_device(config.device)
        if config.tensor_parallel_size > 1:
            from pagedllm.distributed.launcher import rank_device

            self.device = rank_device(self.device, rank)
        self.dtype = choose_dtype(config.model.dtype, self.device)
        path = resolve_model_path(config.model.model)
        self.model_path = path
        ops = cpu_ops() if self.device.type == "cpu" else None
        self.kernel_path = kernel_path() if self.device.type == "cpu" else f"torch on {self.device}"
        self.weight_plan: WeightPlan | None = None
        arch, weights, policy, self.quantization = self._load(path, ops)
        self.arch: ModelArchConfig = arch
        if config.tensor_parallel_size > 1:
            weights = self._start_tensor_parallel(arch, weights, store)
        plan = self.weight_plan
        if plan is not None:  # auto: the measured plan (policy is None: the weights are already packed)
            block_ops = ops if plan.block_kernel else None
            dense = dict(dense_min_tokens=plan.layer_dense_min_tokens, head_dense_min_tokens=plan.head_dense_min_tokens,
                         dense_dtype=_DTYPES[plan.dense_dtype])
        else:
            block_ops = ops if config.quantization == "gguf" else None
            dense = dict(dense_min_tokens=config.quant_dense_min_tokens)
        self.model = LlamaForCausalLM(arch, weights, self.device, self.dtype, policy, tp=self.tp, block_ops=block_ops,
                                      **dense)
        del weights
        max_len = config.model.max_model_len or arch.max_position
        if max_len > arch.max_position:
            raise ValueError(
                f"max_model_len ({max_len}) is larger than the model's context length ({arch.max_position})"
            )
        self.max_model_len = max_len
        self.block_size = config.cache.block_size
        self.draft_model: LlamaForCausalLM | None = None
        self.draft_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        spec = config.speculative
        if spec is not None and spec.method == "draft_model" and rank == 0:
            self.draft_model = self._load_draft(spec.model)  # with tensor parallelism: whole, on rank 0 only
        self.num_blocks = self._num_kv_blocks()
        if self.tp is not None:
            self.num_blocks = self._tp_agree(self.num_blocks)
        needed = math.ceil(self.max_model_len / self.block_size)
        if needed > self.num_blocks:
            raise ValueError(
                f"the KV cache holds {self.num_blocks} blocks of {self.block_size} tokens "
                f"({self.num_blocks * self.block_size} tokens) but max_model_len={self.max_model_len} needs "
                f"{needed} blocks for a single request: raise --kv-cache-memory / --gpu-memory-utilization "
                f"or lower --max-model-len"
            )
        shape = (self.num_blocks, self.block_size, self.model.num_kv_heads, arch.head_dim)
        self.kv_caches = [(self._zeros(shape), self._zeros(shape)) for _ in range(arch.num_layers)]
        self.num_host_blocks = 0
        self.host_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if config.cache.preemption_mode == "swap":
            if self.draft_model is not None:
                raise ValueError("preemption_mode='swap' together with a draft model is not supported yet")
            self.num_host_blocks = config.cache.num_host_blocks_override or int(
                config.cache.swap_space * 2**30 // self.bytes_per_block)
            if self.num_host_blocks < 1:
                raise ValueError(f"swap_space {config.cache.swap_space} GiB holds no KV block "
                                 f"({self.bytes_per_block} bytes each)")
            pin = self.device.type == "cuda"
            self.host_kv_caches = [
                tuple(torch.zeros((self.num_host_blocks, *shape[1:]), dtype=self.dtype, pin_memory=pin)
                      for _ in range(2))
                for _ in range(arch.num_layers)
            ]
        if self.draft_model is not None:
            da = self.draft_model.cfg
            dshape = (self.num_blocks, self.block_size, da.num_kv_heads, da.head_dim)
            self.draft_kv_caches = [(self._zeros(dshape), self._zeros(dshape)) for _ in range(da.num_layers)]
        self.sampler = Sampler()
        self.structured: StructuredOutputs | None = None  # set by the engine (it owns the tokenizer)
        self.requests: dict[str, CachedRequestState] = {}
        logger.info(
            "model %s (%s, %d layers) on %s/%s, weights %s (%.1f MiB), %s; KV cache %d blocks x %d tokens (%.1f MiB)",
            path, arch.arch, arch.num_layers, self.device, self.dtype, self.quantization, self.model.weight_bytes() / 2**20,
            self.kernel_path, self.num_blocks, self.block_size, self.kv_cache_bytes / 2**20,
        )
        if self.tp is not None and rank == 0:
            logger.info("tensor parallelism: %d ranks, weights per rank %s MiB (%.1f MiB in all), KV cache per rank "
                        "%d heads of %d", self.tp.world_size,
                        " / ".join(f"{b / 2**20:.1f}" for b in self.rank_weight_bytes),
                        sum(self.rank_weight_bytes) / 2**20, self.model.num_kv_heads, arch.num_kv_heads)

    def _load(self, path: str, ops):
        """Weights as the flags ask; with ``--dtype auto`` on CPU (no ``--quantization``, one rank, a GGUF of
        4/8-bit blocks, kernels built) the path measured fastest here (``worker.autotune``)."""
        c = self.config
        auto = (c.model.dtype == "auto" and c.quantization is None and self.device.type == "cpu" and ops is not None
                and c.tensor_parallel_size == 1 and path.endswith(".gguf"))
        if auto:
            arch, weights = load_model_files(path, native_q4=True, native_q8=True)
            if blocks_for_autotune(weights, arch.num_layers):
                plan = choose_plan(weights, arch.num_layers, ops)
                self.weight_plan = plan
                logger.info("weight path (%s on this CPU): %s", plan.source, plan.describe())
                if plan.block_kernel:
                    return arch, weights, None, "gguf blocks (auto)"
                self.dtype = _DTYPES[plan.dense_dtype]
                self.weight_plan = None  # dense weights: the plain path below
            del weights
        return load_weights(path, c.quantization, block_kernel=ops is not None and c.quantization == "gguf")

    def describe(self) -> dict:
        """What runs: device, dtype, weight format, kernel path and the auto-chosen plan (logs, /health)."""
        d = {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
             "weights": self.quantization, "kernels": self.kernel_path}
        if self.weight_plan is not None:
            d["weight_plan"] = plan_summary(self.weight_plan)
        return d

    # ------------------------------------------------------------------ tensor parallelism
    def _start_tensor_parallel(self, arch: ModelArchConfig, weights: dict, store) -> dict:
        """Check the model splits (before any worker starts), join the ranks, and keep this rank's shard."""
        from pagedllm.distributed.launcher import join_tensor_parallel
        from pagedllm.distributed.sharding import check_shardable, shard_weights

        check_shardable(arch, weights, self.config.tensor_parallel_size)
        self.tp, self.tp_workers = join_tensor_parallel(self.config, self.rank, self.device, store)
        self._tp_finalizer = weakref.finalize(self, _close_tensor_parallel, self.tp, self.tp_workers)
        return shard_weights(arch, weights, self.rank, self.tp.world_size)

    def _tp_agree(self, num_blocks: int) -> int:
        """Start-up agreement of the ranks: the same model and settings everywhere (a hand-started rank may have
        been given other flags), and a KV block count every rank can hold. Collects each rank's weight bytes."""
        a, c = self.arch, self.config.cache
        settings = [a.vocab_size, a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim,
                    a.intermediate_size, self.block_size, list(_DTYPES.values()).index(self.dtype),
                    zlib.crc32(str(self.quantization).encode()), int(c.preemption_mode == "swap"),
                    int(c.swap_space * 2**30), c.num_host_blocks_override or 0]
        rows = self.tp.gather_ints(settings + [num_blocks, self.model.weight_bytes()])
        for r, row in enumerate(rows):
            if row[: len(settings)] != rows[0][: len(settings)]:
                raise ValueError(
                    f"tensor-parallel rank {r} loaded another model or settings than rank 0 ([vocab, hidden, layers, "
                    f"heads, kv heads, head dim, intermediate, block size, dtype, quantization, swap, swap bytes, "
                    f"host blocks] {row[: len(settings)]} vs {rows[0][: len(settings)]}): start every rank with "
                    f"the same model and engine flags")
        self.rank_weight_bytes = [row[-1] for row in rows]
        return min(row[-2] for row in rows)

    def serve_steps(self) -> None:
        """Ranks > 0: run each step rank 0 sends until it shuts the group down."""
        while (packed := self.tp.recv()) is not None:
            self._forward_step(StepInputs.unpack(packed))

    def inject_forward_fault(self, token_id: int | None) -> None:
        """Fault injection for reliability tests: every forward pass whose batch holds ``token_id`` raises, as a
        failing kernel would (the engine then isolates the request that carries it)."""
        self._fail_token = token_id

    def shutdown(self) -> None:
        """Rank 0 tells the other ranks to stop and waits for its local workers; any rank leaves the group.
        Without tensor parallelism there is nothing to do."""
        if self.tp is not None:
            self._tp_finalizer()

    # ------------------------------------------------------------------ memory
    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Zero-filled KV storage. On CPU it comes from calloc, so pages are committed only when first written:
        the process's resident memory grows with the KV cache actually used, not with the budget."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        nbytes = math.prod(shape) * torch.tensor([], dtype=self.dtype).element_size()
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(self.dtype).view(shape)

    def _load_draft(self, path: str) -> LlamaForCausalLM:
        darch, dweights = load_model_files(resolve_model_path(path))
        a = self.arch
        if darch.vocab_size != a.vocab_size or (
            darch.vocab_fingerprint and a.vocab_fingerprint and darch.vocab_fingerprint != a.vocab_fingerprint
        ):
            raise ValueError(
                f"the draft model {path} does not share the target's vocabulary (vocab sizes {darch.vocab_size} vs "
                f"{a.vocab_size}): speculative decoding needs the same tokenizer"
            )
        if darch.max_position < self.max_model_len:
            raise ValueError(f"the draft model's context ({darch.max_position}) is shorter than max_model_len "
                             f"({self.max_model_len})")
        return LlamaForCausalLM(darch, dweights, self.device, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block across all layers (the draft model's layers included)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        models = [self.model] + ([self.draft_model] if self.draft_model is not None else [])
        return sum(2 * m.cfg.num_layers * self.block_size * m.num_kv_heads * m.cfg.head_dim * elem for m in models)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def _num_kv_blocks(self) -> int:
        c = self.config.cache
        if c.num_gpu_blocks_override is not None:
            return c.num_gpu_blocks_override
        if c.kv_cache_memory is not None:
            budget = c.kv_cache_memory
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            activation_reserve = 1 << 30
            budget = int(total * c.gpu_memory_utilization) - (total - free) - activation_reserve
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        return max(budget // self.bytes_per_block, 0)

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
        if so.is_empty and not (so.swap_out or so.swap_in):
            return ModelRunnerOutput()

        step, groups = StepInputs.from_scheduler_output(so, self.block_size)
        fwd = self._run_step(step)
        out = ModelRunnerOutput()
        if fwd is None:  # KV swaps only
            return out
        if groups:
            self._sample(so, fwd.logits, groups, out)
        if self.draft_model is not None:
            # the draft keeps its own KV for every token the target computes (same block tables and slots)
            self.draft_model.forward(fwd.input_ids, fwd.positions, self.draft_kv_caches, fwd.meta)
        if so.speculate and out.sampled_token_ids:
            out.spec_token_ids = self._propose(so, out)
        return out

    def _run_step(self, step: StepInputs) -> _Forward | None:
        """Rank 0's part of a step that every rank runs. With tensor parallelism rank 0 first hands the step to
        the other ranks; a failure after that leaves the ranks out of step, so it is fatal for the engine."""
        if self.tp is None:
            return self._forward_step(step)
        self.tp.check()
        try:
            self.tp.send_step(step.pack())
            return self._forward_step(step)
        except TensorParallelError:
            raise
        except Exception as e:
            msg = f"rank 0 failed inside a tensor-parallel step ({type(e).__name__}: {e}); the ranks are out of step"
            self.tp.fail(msg)
            raise TensorParallelError(msg) from e

    def _forward_step(self, step: StepInputs) -> _Forward | None:
        """What every rank runs for a step: KV block swaps, the forward pass, the logits of the rows to sample."""
        if step.swap_out or step.swap_in:
            self._swap(step.swap_out, step.swap_in)
        if not step.input_ids:
            return None
        if self._fail_token is not None and self._fail_token in step.input_ids:
            raise RuntimeError(f"injected fault: token {self._fail_token} in the forward pass's batch")
        input_ids, positions, meta, rows = self._step_tensors(step)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden[rows]) if step.logit_rows else None
        return _Forward(input_ids, positions, meta, logits)

    def _sample(self, so: SchedulerOutput, logits: torch.Tensor, groups, out: ModelRunnerOutput) -> None:
        """Sample every request that reached the end of its tokens; verify its drafts if it had any.

        A request with k drafts has k+1 rows: the target's distribution after its last token and after each
        draft. Penalties and min_tokens at row i see the drafts before it as output tokens."""
        vstates, vextra = [], []
        for s, first, n in groups:
            st = self.requests[s.req_id]
            del st.output_token_ids[s.num_output_tokens :]  # keep in step with the scheduler's view
            spec = s.token_ids[len(s.token_ids) - s.num_spec_tokens :]
            for i in range(n):
                vstates.append(st)
                vextra.append(spec[:i])
        smeta = self._sampling_metadata(vstates, vextra, logits.shape[1])
        smeta.allowed = self._grammar_masks(groups, logits.shape[1])
        random_spec = [g for g in groups if g[0].num_spec_tokens and self.requests[g[0].req_id].sampling_params.temperature > 0]
        res = self.sampler(logits, smeta, return_probs=bool(random_spec))
        tokens = res.token_ids.tolist()
        new_tokens: dict[str, list[int]] = {}
        for s, first, n in groups:
            if not s.num_spec_tokens:
                new_tokens[s.req_id] = [tokens[first]]
            elif self.requests[s.req_id].sampling_params.temperature == 0:
                spec = s.token_ids[len(s.token_ids) - s.num_spec_tokens :]
                acc = []
                for i, d in enumerate(spec):
                    acc.append(tokens[first + i])
                    if tokens[first + i] != d:
                        break
                else:
                    acc.append(tokens[first + len(spec)])
                new_tokens[s.req_id] = acc
        if random_spec:
            new_tokens.update(self._verify_random(random_spec, res.probs))
        lp_rows, lp_toks, lp_owner = [], [], []
        for s, first, n in groups:
            st = self.requests[s.req_id]
            new = new_tokens[s.req_id]
            st.output_token_ids.extend(new)
            if st.matcher is not None:
                self._sync_matcher(st)
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

    def _sync_matcher(self, st: CachedRequestState):
        """The request's grammar matcher, made on first use and brought in step with its output tokens (new ones
        consumed; ones the scheduler dropped, e.g. rejected drafts, rolled back)."""
        if st.matcher is None:
            st.matcher = self.structured.matcher(st.sampling_params.structured_outputs)
            st.consumed = 0
        n = len(st.output_token_ids)
        if st.consumed > n:
            st.matcher.rollback(st.consumed - n)
        elif st.consumed < n:
            for t in st.output_token_ids[st.consumed :]:
                if not st.matcher.consume_token(t):
                    logger.warning("request %s: token %d is outside its grammar (%s)", st.req_id, t,
                                   st.matcher.get_error())
                    break
        st.consumed = n
        return st.matcher

    def _grammar_masks(self, groups, vocab: int):
        """(rows, allowed) for the step's constrained requests, or None. A request verifying k drafts has k+1
        rows: row i is masked by its grammar's state after drafts[:i] (the drafts are consumed for this and
        rolled back; the tokens the verification accepts are consumed after sampling)."""
        rows, masks = [], []
        for s, first, n in groups:
            st = self.requests[s.req_id]
            if st.sampling_params.structured_outputs is None:
                continue
            m = self._sync_matcher(st)
            spec = s.token_ids[len(s.token_ids) - s.num_spec_tokens :]
            consumed = 0
            for i in range(n):
                rows.append(first + i)
                masks.append(fill_bitmasks([m], vocab))
                if i < len(spec) and consumed == i and m.consume_token(spec[i]):
                    consumed += 1  # past a draft the grammar refuses, the later rows' samples are discarded
            m.rollback(consumed)
        if not rows:
            return None
        allowed = unpack_bitmasks(torch.cat(masks), vocab).to(self.device)
        return torch.tensor(rows, device=self.device), allowed

    def _verify_random(self, groups, probs: torch.Tensor) -> dict[str, list[int]]:
        """Rejection sampling for sampled (temperature > 0) requests; drafts are deterministic (one-hot q)."""
        k = max(s.num_spec_tokens for s, _, _ in groups)
        vocab = probs.shape[1]
        dev = probs.device
        p = torch.zeros(len(groups), k + 1, vocab, device=dev)
        drafts = torch.zeros(len(groups), k, dtype=torch.long, device=dev)
        uniforms = torch.empty(len(groups), k, device=dev)
        noise = torch.empty(len(groups), k + 1, vocab, device=dev)
        for j, (s, first, n) in enumerate(groups):
            p[j, :n] = probs[first : first + n]
            spec = s.token_ids[len(s.token_ids) - s.num_spec_tokens :]
            drafts[j, : len(spec)] = torch.tensor(spec, device=dev)
            gen = self.requests[s.req_id].generator
            uniforms[j].uniform_(generator=gen)
            noise[j].exponential_(generator=gen)
        toks = rejection_sample(p, drafts, [s.num_spec_tokens for s, _, _ in groups], uniforms, noise)
        return {s.req_id: t for (s, _, _), t in zip(groups, toks)}

    def _swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks device -> host (swap-outs first: their device blocks may be reused this step),
        then host -> device."""
        if swap_out:
            dev = torch.tensor([d for d, _ in swap_out], device=self.device)
            host = torch.tensor([h for _, h in swap_out])
            for (kc, vc), (hk, hv) in zip(self.kv_caches, self.host_kv_caches):
                hk.index_copy_(0, host, kc.index_select(0, dev).to("cpu"))
                hv.index_copy_(0, host, vc.index_select(0, dev).to("cpu"))
        if swap_in:
            host = torch.tensor([h for h, _ in swap_in])
            dev = torch.tensor([d for _, d in swap_in], device=self.device)
            for (kc, vc), (hk, hv) in zip(self.kv_caches, self.host_kv_caches):
                kc.index_copy_(0, dev, hk.index_select(0, host).to(self.device))
                vc.index_copy_(0, dev, hv.index_select(0, host).to(self.device))

    # ------------------------------------------------------------------ proposers
    def _propose(self, so: SchedulerOutput, out: ModelRunnerOutput) -> dict[str, list[int]]:
        cfg = self.config.speculative
        k = cfg.num_speculative_tokens
        budget = {}
        for rid in out.sampled_token_ids:
            st = self.requests[rid]
            n_tok = len(st.prompt_token_ids) + len(st.output_token_ids)
            budget[rid] = min(k, self.max_model_len - n_tok - 1)  # drafts must fit the context
        if cfg.method == "ngram":
            res = {}
            for rid, kk in budget.items():
                if kk > 0:
                    st = self.requests[rid]
                    res[rid] = propose_ngram(st.prompt_token_ids + st.output_token_ids, cfg.prompt_lookup_min,
                                             cfg.prompt_lookup_max, kk)
        else:
            res = self._propose_draft(budget, {s.req_id: s.block_ids for s in so.scheduled})
        for rid, drafts in res.items():  # a constrained request keeps only the drafts its grammar accepts
            m = self.requests[rid].matcher
            if m is not None and drafts:
                ok = m.try_consume_tokens(drafts)
                m.rollback(ok)
                del drafts[ok:]
        return res

    @torch.inference_mode()
    def _propose_draft(self, budget: dict[str, int], tables: dict[str, list[int]]) -> dict[str, list[int]]:
        """Greedy drafts from the draft model, k decode passes batched over the requests."""
        bs = self.block_size
        active = [rid for rid, kk in budget.items() if kk > 0]
        pos = {}
        last = {}
        for rid in active:
            st = self.requests[rid]
            pos[rid] = len(st.prompt_token_ids) + len(st.output_token_ids) - 1  # the newest token, not in KV yet
            last[rid] = st.output_token_ids[-1]
        res: dict[str, list[int]] = {rid: [] for rid in active}
        while active:
            dev = self.device
            slots = [tables[r][pos[r] // bs] * bs + pos[r] % bs for r in active]
            dec_tables = [tables[r][: pos[r] // bs + 1] for r in active]
            meta = self._decode_metadata(slots, dec_tables, [pos[r] + 1 for r in active])
            hidden = self.draft_model.forward(
                torch.tensor([last[r] for r in active], device=dev), torch.tensor([pos[r] for r in active], device=dev),
                self.draft_kv_caches, meta,
            )
            nxt = self.draft_model.compute_logits(hidden).argmax(dim=-1).tolist()
            still = []
            for r, t in zip(active, nxt):
                res[r].append(t)
                last[r] = t
                pos[r] += 1
                if len(res[r]) < budget[r]:
                    still.append(r)
            active = still
        return res

    def _decode_metadata(self, slots: list[int], tables: list[list[int]], lens: list[int]) -> AttentionMetadata:
        dev = self.device
        bs = self.block_size
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        mask = None
        if self.model.ops is None:  # the fused kernel stops at each row's length; SDPA needs the mask
            mask = (torch.arange(max_blocks * bs, device=dev)[None, :] < lens_t[:, None])[:, None, None, :]
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decode_rows=None,
            decode_block_tables=torch.tensor(padded, dtype=torch.long, device=dev),
            decode_mask=mask, num_decodes=len(slots), prefills=[], decode_lens=lens_t,
        )

    def _step_tensors(self, step: StepInputs):
        """The step's lists as device tensors: token ids, positions, attention metadata, logit rows.

        With the fused CPU kernels, the query rows of short prefill chunks (context up to
        ``ROW_KERNEL_MAX_CONTEXT``) join the decode rows: each row attends over its own context length, so one
        kernel call covers them all (no per-sequence gather); longer chunks use the tiled attention's matmuls."""
        dev = self.device
        rows, tables, lens = list(step.decode_rows), list(step.decode_tables), list(step.decode_lens)
        prefills = []
        for (start, end, ctx), table in zip(step.prefills, step.prefill_tables):
            if self.model.ops is not None and ctx <= ROW_KERNEL_MAX_CONTEXT:
                rows.extend(range(start, end))
                tables.extend([table] * (end - start))
                lens.extend(range(ctx - (end - start) + 1, ctx + 1))
            else:
                prefills.append(PrefillSeq(start, end, ctx, torch.tensor(table, dtype=torch.long, device=dev)))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(step.slots, dtype=torch.long, device=dev),
            decode_rows=None, decode_block_tables=None, decode_mask=None,
            num_decodes=len(rows), prefills=prefills,
        )
        if rows:
            dm = self._decode_metadata([], tables, lens)
            meta.decode_block_tables, meta.decode_mask, meta.decode_lens = dm.decode_block_tables, dm.decode_mask, dm.decode_lens
            if rows != list(range(len(step.input_ids))):  # None: every row, in order
                meta.decode_rows = torch.tensor(rows, dtype=torch.long, device=dev)
        return (
            torch.tensor(step.input_ids, dtype=torch.long, device=dev),
            torch.tensor(step.positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(step.logit_rows, dtype=torch.long, device=dev),
        )

    def _sampling_metadata(self, states: list[CachedRequestState], extras: list[list[int]], vocab: int) -> SamplingMetadata:
        """One row per state; ``extras[i]`` are draft tokens that row i treats as already generated."""
        dev = self.device
        sps = [st.sampling_params for st in states]
        greedy = [sp.temperature == 0.0 for sp in sps]
        temps = [1.0 if g else sp.temperature for g, sp in zip(greedy, sps)]
        all_greedy = all(greedy)
        top_k = top_p = min_p = None
        if not all_greedy:
            if any(sp.top_k > 0 for sp in sps):
                top_k = torch.tensor([sp.top_k if sp.top_k > 0 else vocab for sp in sps], device=dev)
            if any(sp.top_p < 1.0 for sp in sps):
                top_p = torch.tensor([sp.top_p for sp in sps], dtype=torch.float32, device=dev)
            if any(sp.min_p > 0.0 for sp in sps):
                min_p = torch.tensor([sp.min_p for sp in sps], dtype=torch.float32, device=dev)
        generators = {i: st.generator for i, st in enumerate(states) if st.generator is not None}

        rep = pres = freq = out_toks = prompt_toks = None
        if any(sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty for sp in sps):
            rep = torch.tensor([sp.repetition_penalty for sp in sps], dtype=torch.float32, device=dev)
            pres = torch.tensor([sp.presence_penalty for sp in sps], dtype=torch.float32, device=dev)
            freq = torch.tensor([sp.frequency_penalty for sp in sps], dtype=torch.float32, device=dev)
            out_toks = _pad([st.output_token_ids + ex for st, ex in zip(states, extras)], vocab, dev)
            prompt_toks = _pad([st.prompt_token_ids for st in states], vocab, dev)

        logit_bias = None
        lb = [(i, t, b) for i, sp in enumerate(sps) if sp.logit_bias for t, b in sp.logit_bias.items()]
        if lb:
            rows, toks, vals = zip(*lb)
            logit_bias = (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev),
                          torch.tensor(vals, dtype=torch.float32, device=dev))

        banned = None
        eos = self.arch.eos_token_id
        ban = []
        for i, (st, sp) in enumerate(zip(states, sps)):
            if len(st.output_token_ids) + len(extras[i]) < sp.min_tokens:
                ids = set(sp.stop_token_ids or [])
                if eos is not None and not sp.ignore_eos:
                    ids.add(eos)
                ban.extend((i, t) for t in ids)
        if ban:
            rows, toks = zip(*ban)
            banned = (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev))

        wanted = [sp.logprobs for sp in sps if sp.logprobs is not None]
        return SamplingMetadata(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            greedy=torch.tensor(greedy, device=dev),
            all_greedy=all_greedy,
            top_k=top_k, top_p=top_p, min_p=min_p, generators=generators,
            repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
            output_tokens=out_toks, prompt_tokens=prompt_toks,
            logit_bias=logit_bias, banned=banned,
            max_num_logprobs=max(wanted) if wanted else None,
        )


def _pad(rows: list[list[int]], pad: int, dev: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=dev)


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
