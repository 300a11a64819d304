"""The event loop: the real scheduler and KV cache manager of ``pagedllm.core`` on a virtual clock, with the cost
model in place of the model runner.

Each step: requests that have arrived are added; ``Scheduler.schedule()`` decides the step (chunked prefill,
token budget, max_num_seqs, preemption, prefix-cache hits, speculative lookahead); the cost model prices exactly
that mix of prefill chunks and decodes; the clock advances; fake sampled tokens (and, with speculative decoding,
draft tokens accepted with probability ``acceptance_rate`` each) go back through
``Scheduler.update_from_output``. Requests have fixed output lengths (``max_tokens`` with ``ignore_eos``).
Prompts are fake token ids: a shared prefix uses the same ids in every request of its group, so prefix-cache
hits happen exactly where the real cache would find them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.request import Request
from pagedllm.routing import ReplicaRouter
from pagedllm.sampling_params import SamplingParams
from pagedllm.sim.cost import CostModel, Deployment, MemoryPlan, SeqWork, work_from_scheduler_output
from pagedllm.sim.metrics import RequestRecord, Summary, summarize
from pagedllm.sim.trace import Workload

# fake token ids (the block hashes pack them as signed 64-bit integers)
_PREFIX_BASE = 10**12  # + group * 10**9 + position: shared prefixes
_UNIQUE_BASE = 2 * 10**15  # + request * 10**7 + position: the rest of a prompt
_OUTPUT_BASE = 3 * 10**15  # + request * 10**7 + position: sampled and draft tokens


@dataclass(frozen=True)
class SpecDecoding:
    """Speculative decoding through the scheduler's lookahead slots: every decoding request proposes ``k``
    drafts per step, each accepted with probability ``acceptance_rate`` until the first rejection. Drafts are
    free (n-gram lookup) unless ``draft`` gives a draft model's deployment to price."""

    num_speculative_tokens: int = 4
    acceptance_rate: float = 0.7
    draft: Deployment | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 0 <= self.acceptance_rate < 1:
            raise ValueError(f"acceptance_rate must be in [0, 1), got {self.acceptance_rate}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")

    @property
    def expected_tokens_per_step(self) -> float:
        """(1 - a^(k+1)) / (1 - a): accepted drafts plus the token sampled after them."""
        a, k = self.acceptance_rate, self.num_speculative_tokens
        return (1 - a ** (k + 1)) / (1 - a)


@dataclass(frozen=True)
class EngineSettings:
    """The engine flags that shape scheduling (same names and defaults as ``pagedllm serve``)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: as serve (2048; with chunked prefill off, the context)
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # None: the model's context length
    num_blocks: int | None = None  # exact KV block count (tests); None: from the deployment's memory plan
    spec: SpecDecoding | None = None

    def __post_init__(self) -> None:
        for f in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, f) is not None and getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")


@dataclass
class SimResult:
    summary: Summary
    records: list[RequestRecord]
    kv_timeline: list[tuple[float, float]] = field(default_factory=list)  # (time, KV usage) per step
    step_times: list[float] = field(default_factory=list)

    def to_dict(self, max_points: int = 200) -> dict:
        tl = self.kv_timeline
        stride = max(1, len(tl) // max_points)
        return {"summary": self.summary.to_dict(), "kv_timeline": [list(p) for p in tl[::stride]]}


class _Clock:
    """The scheduler's clock: virtual seconds."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _prompt_ids(i: int, prompt_len: int, shared: int, group: int) -> list[int]:
    pre = [_PREFIX_BASE + group * 10**9 + j for j in range(shared)]
    return pre + [_UNIQUE_BASE + i * 10**7 + j for j in range(prompt_len - shared)]


class _FakeRunner:
    """Stands where the model runner stands: a made-up token for every row that samples; with speculative
    decoding, each draft accepted with probability ``acceptance_rate`` until the first rejection, and ``k`` new
    drafts proposed. Request ids are trace indices."""

    def __init__(self, spec: SpecDecoding | None, rng: random.Random) -> None:
        self.spec = spec
        self.rng = rng
        self.num_verifies = self.num_accepted = 0

    def execute(self, so, requests: dict[str, Request]) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        for s in so.scheduled:
            if not s.sample:
                continue  # a prefill chunk that does not reach the end of the prompt
            accepted = 0
            if s.num_spec_tokens:
                while accepted < s.num_spec_tokens and self.rng.random() < self.spec.acceptance_rate:
                    accepted += 1
                self.num_verifies += 1
                self.num_accepted += accepted
            base = _OUTPUT_BASE + int(s.req_id) * 10**7 + requests[s.req_id].num_output_tokens
            result.sampled_token_ids[s.req_id] = [base + j for j in range(accepted + 1)]
            if so.speculate:
                nxt = base + accepted + 1
                result.spec_token_ids[s.req_id] = [nxt + j for j in range(self.spec.num_speculative_tokens)]
        return result


class _Arrivals:
    """When requests reach the engine: at their trace times (open loop), or from closed-loop clients, each
    sending its next request uniform(0, client_jitter_s) after its previous one finished."""

    def __init__(self, workload: Workload, rng: random.Random) -> None:
        self.w = workload
        self.rng = rng
        n = len(workload.requests)
        if workload.concurrency is not None:
            n0 = min(workload.concurrency, n)
            self.pending = sorted((rng.uniform(0, workload.client_jitter_s), i) for i in range(n0))
            self.next_idx = n0
        else:
            self.pending = sorted((r.arrival_s, i) for i, r in enumerate(workload.requests))
            self.next_idx = n
        self.pos = 0
        self.first_s = self.pending[0][0]

    def due(self, now: float) -> list[tuple[float, int]]:
        out = []
        while self.pos < len(self.pending) and self.pending[self.pos][0] <= now:
            out.append(self.pending[self.pos])
            self.pos += 1
        return out

    def next_time(self) -> float | None:
        return self.pending[self.pos][0] if self.pos < len(self.pending) else None

    def finished(self, now: float) -> None:
        """A request finished: its closed-loop client sends the next one of the trace."""
        if self.w.concurrency is not None and self.next_idx < len(self.w.requests):
            self.pending.append((now + self.rng.uniform(0, self.w.client_jitter_s), self.next_idx))
            self.next_idx += 1
            self.pending[self.pos:] = sorted(self.pending[self.pos:])


CHAIN_TOKENS = 8  # tokens per link of the chain the cache-aware router matches (the balancer's 32 characters)


def _request_chain(i: int, r) -> list[int]:
    """The routing chain of trace request ``i``: its shared prefix (by group) then its own tokens, in 8-token
    links, as the balancer chains a request's text."""
    out, h = [], 0
    for k in range(min(r.prompt_len, 4096) // CHAIN_TOKENS):
        end = (k + 1) * CHAIN_TOKENS
        link = ("g", r.prefix_group, k) if end <= r.shared_prefix_len else ("r", i, k)
        h = hash((h, link))
        out.append(h)
    return out


class _Engine:
    """One replica: the real scheduler and KV cache manager, its cost model, and the step it is running."""

    def __init__(self, dep: Deployment, settings: EngineSettings, num_blocks: int, max_len: int,
                 rng: random.Random, plan: MemoryPlan) -> None:
        spec = settings.spec
        # the model's own KV layout: a block table per layer group, sliding groups freeing what left their window;
        # a hybrid model's state slots (a running request holds one; prefix hits restore the free ones' snapshots)
        self.kv = KVCacheManager(num_blocks, settings.block_size, settings.enable_prefix_caching,
                                 windows=dep.model.kv_layout.windows, num_state_slots=plan.state_slots,
                                 state_live_slots=plan.state_live_slots)
        self.sched = Scheduler(
            SchedulerConfig(max_num_batched_tokens=settings.max_num_batched_tokens,
                            max_num_seqs=settings.max_num_seqs, enable_chunked_prefill=settings.enable_chunked_prefill),
            CacheConfig(block_size=settings.block_size, enable_prefix_caching=settings.enable_prefix_caching), self.kv,
            max_len, num_lookahead_slots=spec.num_speculative_tokens if spec else 0,
            spec_disable_by_batch_size=spec.disable_by_batch_size if spec else None)
        self.clock = _Clock()
        self.sched.clock = self.clock
        self.cost = CostModel(dep)
        self.draft_cost = CostModel(spec.draft) if spec is not None and spec.draft is not None else None
        self.spec = spec
        self.runner = _FakeRunner(spec, rng)
        self.num_blocks, self.block_size = num_blocks, settings.block_size
        self.timeline: list[tuple[float, float]] = []
        self.step_times: list[float] = []
        self.usage_area = self.usage_max = 0.0
        self.prefill_computed = 0
        self.in_flight = 0
        self.running = None  # the SchedulerOutput of the step in progress
        self.busy_until: float | None = None
        # lending (``simulate``'s ``lend``): the machine-wide cost model, and the step in progress priced on both
        self.lend_cost: CostModel | None = None
        self.borrowing = False
        self.own_dt = self.lend_dt = 0.0

    def wants_step(self) -> bool:
        return self.busy_until is None and self.sched.has_unfinished_requests()

    def idle(self) -> bool:
        """Lends its cores: no step and no request (the engine tells its runner when its last one finished)."""
        return self.busy_until is None and not self.sched.has_unfinished_requests()

    def start_step(self, now: float, state: dict, borrow: bool = False) -> None:
        """Schedule and price the next step at ``now`` (if there is work); it ends at ``busy_until``. ``borrow``:
        every other replica is idle, so the step runs on the whole machine's cores (``lend_cost``)."""
        if not self.sched.has_unfinished_requests():
            return
        self.clock.t = now
        so = self.sched.schedule()
        if so.is_empty:
            raise RuntimeError(f"the scheduler made no progress: {self.sched.waiting.peek()!r} does not fit in the "
                               f"KV cache ({self.num_blocks} blocks of {self.block_size} tokens)")
        work = work_from_scheduler_output(so)
        dt = self.cost.step_time(work)
        self.borrowing = borrow and self.lend_cost is not None
        if self.borrowing:
            self.own_dt, self.lend_dt = dt, self.lend_cost.step_time(work)
            dt = self.lend_dt
        if self.draft_cost is not None:
            dt += _draft_time(self.draft_cost, work, so.speculate, self.spec.num_speculative_tokens)
        usage = self.kv.usage()
        self.timeline.append((now, usage))
        self.usage_area += usage * dt
        self.usage_max = max(self.usage_max, usage)
        self.step_times.append(dt)
        for s in so.scheduled:  # prompt tokens computed (again, after a preemption by recompute)
            end = s.num_computed_tokens + len(s.token_ids) - s.num_spec_tokens
            self.prefill_computed += max(0, min(end, state[s.req_id]["req"].num_prompt_tokens) - s.num_computed_tokens)
        self.running, self.busy_until = so, now + dt

    def give_back(self, now: float) -> None:
        """A sibling started a step while this one ran on its cores: the rest of the step (its share of the work
        left) runs on this replica's own cores, as the engine gives them back between layers."""
        if not self.borrowing:
            return
        self.borrowing = False
        left = (self.busy_until - now) * self.own_dt / self.lend_dt
        self.step_times[-1] += now + left - self.busy_until
        self.busy_until = now + left

    def finish_step(self) -> list:
        """The step in progress ends: its sampled tokens go back through the scheduler."""
        so, self.running = self.running, None
        self.clock.t, self.busy_until = self.busy_until, None
        self.borrowing = False
        return self.sched.update_from_output(so, self.runner.execute(so, self.sched.requests))


def simulate(dep: Deployment, workload: Workload, settings: EngineSettings = EngineSettings(), seed: int = 0,
             system: str = "pagedllm (paged KV, continuous batching)", replicas: int = 1,
             routing: str = "cache_aware", lend: Deployment | None = None) -> SimResult:
    """The workload on ``replicas`` engines of deployment ``dep`` (each with its own KV cache), a request going to
    one at its arrival by ``routing`` (``pagedllm.routing``: the balancer's policies). ``lend``: the same model on
    the whole machine (all the replicas' cores): a step that starts while every other replica is idle runs there,
    as `serve --data-parallel-size` replicas lend idle cores (``worker.core_share``), until a sibling starts a step
    (then the rest of it runs on the replica's own share). With more than two replicas a step borrows only when
    all the others are idle (the engine also borrows from some: so this underrates lending there)."""
    model = dep.model
    plan = dep.memory_plan(settings.block_size, settings.max_num_seqs, settings.enable_prefix_caching)
    num_blocks = settings.num_blocks or plan.num_blocks
    if num_blocks < 1:
        raise ValueError(f"{model.name} ({dep.scheme.name}, {plan.weights_per_device / 2**30:.1f} GiB of weights per "
                         f"device) leaves no memory for the KV cache on {dep.tp} x {dep.hardware.name}")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    max_len = settings.max_model_len or model.max_position
    for r in workload.requests:
        if r.prompt_len + r.output_len > max_len:
            raise ValueError(f"a request of {r.prompt_len} + {r.output_len} tokens exceeds max_model_len {max_len}")
    rng = random.Random(seed)
    engines = [_Engine(dep, settings, num_blocks, max_len, rng, plan) for _ in range(replicas)]
    if lend is not None and replicas > 1:
        for e in engines:
            e.lend_cost = CostModel(lend)
    router = ReplicaRouter(replicas, routing)
    arrivals = _Arrivals(workload, rng)
    reqs = workload.requests
    state: dict[str, dict] = {}  # request id -> its Request, engine and timings
    records: list[RequestRecord] = []
    now = 0.0

    while True:
        # the next event: a step ending (first, at a tie: its finished requests' clients may send at that time)
        # or an arrival
        ending = min((e for e in engines if e.busy_until is not None), key=lambda e: e.busy_until, default=None)
        nxt = arrivals.next_time()
        if ending is None and nxt is None:
            break
        if ending is not None and (nxt is None or ending.busy_until <= nxt):
            now = ending.busy_until
            for out in ending.finish_step():
                st = state[out.req_id]
                if st["first"] is None and out.new_token_ids:
                    st["first"] = now
                    st["cached"] = out.num_cached_tokens
                st["out"] += len(out.new_token_ids)
                if out.finish_reason is not None:
                    req = st.pop("req")
                    ending.in_flight -= 1
                    records.append(RequestRecord(req.arrival_time, st["first"], now, req.num_prompt_tokens,
                                                 st["out"], st["cached"], req.num_preemptions))
                    arrivals.finished(now)
        else:
            now = nxt
        for t, i in arrivals.due(now):
            r = reqs[i]
            e = engines[0] if replicas == 1 else engines[router.choose(
                _request_chain(i, r), {k: x.in_flight for k, x in enumerate(engines)})]
            sp = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            req = Request(str(i), _prompt_ids(i, r.prompt_len, r.shared_prefix_len, r.prefix_group), sp,
                          eos_token_id=None, max_tokens=r.output_len, arrival_time=t)
            e.sched.add_request(req)
            e.in_flight += 1
            state[req.request_id] = {"req": req, "first": None, "cached": 0, "out": 0}
        starting = [e for e in engines if e.wants_step()]
        if starting and replicas > 1:
            for e in engines:  # a step on borrowed cores meets a sibling's new step: the cores go back
                if e.busy_until is not None:
                    e.give_back(now)
        for e in starting:
            e.start_step(now, state, borrow=all(x.idle() for x in engines if x is not e))

    start_s, end_s = arrivals.first_s, now
    span = max(end_s - start_s, 1e-12)
    queries = sum(e.kv.prefix_cache_queries for e in engines)
    verifies = sum(e.runner.num_verifies for e in engines)
    summary = summarize(
        system, records, start_s, end_s, dep.num_devices * replicas, dep.hardware.price_per_hour,
        dep.weight_bytes * replicas,
        num_blocks * dep.kv_bytes_per_block(settings.block_size) * dep.num_devices * replicas,
        kv_usage_max=max(e.usage_max for e in engines),
        kv_usage_mean=sum(e.usage_area for e in engines) / span / replicas,
        preemptions=sum(e.sched.counters.num_preemptions for e in engines),
        prefix_hit_rate=sum(e.kv.prefix_cache_hits for e in engines) / queries if queries else 0.0,
        num_steps=sum(len(e.step_times) for e in engines),
        prefill_tokens_computed=sum(e.prefill_computed for e in engines),
        spec_mean_accepted=sum(e.runner.num_accepted for e in engines) / verifies if verifies else None,
        state_pool_bytes=plan.state_bytes_per_device * dep.num_devices * replicas,
    )
    records.sort(key=lambda r: r.arrival_s)
    timeline = sorted(p for e in engines for p in e.timeline) if replicas > 1 else engines[0].timeline
    return SimResult(summary, records, timeline, [t for e in engines for t in e.step_times])


def _draft_time(draft: CostModel, work: tuple[SeqWork, ...], speculate: bool, k: int) -> float:
    """A draft model runs over the step's tokens (keeping its own KV), then proposes k tokens for each request
    that sampled: k - 1 more single-token steps."""
    t = draft.step_time([SeqWork(w.query_tokens, w.context_before, 0) for w in work])
    proposers = [SeqWork(1, w.context_before + w.query_tokens, 1) for w in work if w.sampled_rows]
    if speculate and proposers:
        t += (k - 1) * draft.step_time(proposers)
    return t
