"""The model runner: the only place that owns the device and its tensors.

It turns a ``SchedulerOutput`` into input tensors (flat tokens, positions, slot mapping, block tables), runs the
model, samples, and returns a ``ModelRunnerOutput`` of plain ints and lists.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.config import EngineConfig, resolve_model_path
from pagedllm.layers.attention import AttentionMetadata, PrefillSeq
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import ModelArchConfig, load_model_files
from pagedllm.outputs import ModelRunnerOutput, SampledTokenLogprobs, SchedulerOutput
from pagedllm.sample.sampler import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
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


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = choose_device(config.device)
        self.dtype = choose_dtype(config.model.dtype, self.device)
        path = resolve_model_path(config.model.model)
        self.model_path = path
        arch, weights = load_model_files(path)
        self.arch: ModelArchConfig = arch
        self.model = LlamaForCausalLM(arch, weights, self.device, self.dtype)
        del weights
        max_len = config.model.max_model_len or arch.max_position
        if max_len > arch.max_position:
            raise ValueError(
                f"max_model_len ({max_len}) is larger than the model's context length ({arch.max_position})"
            )
        self.max_model_len = max_len
        self.block_size = config.cache.block_size
        self.num_blocks = self._num_kv_blocks()
        needed = math.ceil(self.max_model_len / self.block_size)
        if needed > self.num_blocks:
            raise ValueError(
                f"the KV cache holds {self.num_blocks} blocks of {self.block_size} tokens "
                f"({self.num_blocks * self.block_size} tokens) but max_model_len={self.max_model_len} needs "
                f"{needed} blocks for a single request: raise --kv-cache-memory / --gpu-memory-utilization "
                f"or lower --max-model-len"
            )
        shape = (self.num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [(self._zeros(shape), self._zeros(shape)) for _ in range(arch.num_layers)]
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        logger.info(
            "model %s (%s, %d layers) on %s/%s: weights %.1f MiB, KV cache %d blocks x %d tokens (%.1f MiB)",
            path, arch.arch, arch.num_layers, self.device, self.dtype, self.model.weight_bytes() / 2**20,
            self.num_blocks, self.block_size, self.kv_cache_bytes / 2**20,
        )

    # ------------------------------------------------------------------ memory
    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Zero-filled KV storage. On CPU it comes from calloc, so pages are committed only when first written:
        the process's resident memory grows with the KV cache actually used, not with the budget."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        nbytes = math.prod(shape) * torch.tensor([], dtype=self.dtype).element_size()
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(self.dtype).view(shape)

    @property
    def bytes_per_block(self) -> int:
        a = self.arch
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * elem

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
        if so.is_empty:
            return ModelRunnerOutput()

        input_ids, positions, meta, sample_rows, sample_ids = self._prepare_inputs(so)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
        if not sample_ids:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[sample_rows])
        states = [self.requests[rid] for rid in sample_ids]
        for st, s in zip(states, (s for s in so.scheduled if s.sample)):
            del st.output_token_ids[s.num_output_tokens :]  # keep in step with the scheduler's view
        smeta = self._sampling_metadata(states, logits.shape[1])
        res = self.sampler(logits, smeta)
        tokens = res.token_ids.tolist()
        out = ModelRunnerOutput()
        lp_lists = None
        if res.logprobs is not None:
            lp_lists = (
                res.logprobs.tolist(), res.ranks.tolist(),
                res.top_ids.tolist() if res.top_ids is not None else None,
                res.top_logprobs.tolist() if res.top_logprobs is not None else None,
            )
        for i, (rid, st, tok) in enumerate(zip(sample_ids, states, tokens)):
            st.output_token_ids.append(tok)
            out.sampled_token_ids[rid] = tok
            k = st.sampling_params.logprobs
            if k is not None and lp_lists is not None:
                top = list(zip(lp_lists[2][i][:k], lp_lists[3][i][:k])) if k > 0 else []
                out.logprobs[rid] = SampledTokenLogprobs(tok, lp_lists[0][i], lp_lists[1][i], top)
        return out

    def _prepare_inputs(self, so: SchedulerOutput):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        for s in so.scheduled:
            start = len(input_ids)
            n = len(s.token_ids)
            nc = s.num_computed_tokens
            input_ids.extend(s.token_ids)
            positions.extend(range(nc, nc + n))
            table = s.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(nc, nc + n))
            if n == 1:
                decode_rows.append(start)
                decode_tables.append(table[: (nc + bs) // bs])
                decode_lens.append(nc + 1)
            else:
                ctx = nc + n
                prefills.append(PrefillSeq(start, start + n, ctx, torch.tensor(table[: -(-ctx // bs)], device=self.device)))
            if s.sample:
                sample_rows.append(start + n - 1)
                sample_ids.append(s.req_id)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decode_rows=None, decode_block_tables=None, decode_mask=None,
            num_decodes=len(decode_rows), prefills=prefills,
        )
        if decode_rows:
            max_blocks = max(len(t) for t in decode_tables)
            padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=dev)
            lens = torch.tensor(decode_lens, device=dev)
            meta.decode_mask = (torch.arange(max_blocks * bs, device=dev)[None, :] < lens[:, None])[:, None, None, :]
            if len(decode_rows) != len(input_ids):
                meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=dev)
        return (
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(sample_rows, dtype=torch.long, device=dev),
            sample_ids,
        )

    def _sampling_metadata(self, states: list[CachedRequestState], vocab: int) -> SamplingMetadata:
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
            out_toks = _pad([st.output_token_ids for st in states], vocab, dev)
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
            if len(st.output_token_ids) < sp.min_tokens:
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
