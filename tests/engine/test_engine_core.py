"""EngineCore with a fake model runner injected (no model, no torch): prompt checks, steps, finish reasons, and a
request the runner fails on isolated from the others."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pagedllm.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.core import EngineCore
from pagedllm.errors import EngineFatalError
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.request import FinishReason, Request
from pagedllm.sampling_params import SamplingParams

POISON = 66  # the fake runner fails on any batch holding this token


class FakeRunner:
    max_model_len = 64
    num_blocks = 32
    num_host_blocks = 0
    arch = SimpleNamespace(vocab_size=100)

    def __init__(self, fatal: bool = False) -> None:
        self.fatal = fatal
        self.batches = []
        self.closed = False

    def execute(self, so) -> ModelRunnerOutput:
        self.batches.append([s.req_id for s in so.scheduled])
        if any(POISON in s.token_ids for s in so.scheduled):
            raise (EngineFatalError if self.fatal else RuntimeError)("boom")
        return ModelRunnerOutput(sampled_token_ids={s.req_id: [7] for s in so.scheduled if s.sample})

    def shutdown(self) -> None:
        self.closed = True

    def went_idle(self) -> None:
        self.idle_calls = getattr(self, "idle_calls", 0) + 1


def make_core(runner=None, **scheduler_options) -> EngineCore:
    config = EngineConfig(cache=CacheConfig(block_size=4), scheduler=SchedulerConfig(**scheduler_options))
    return EngineCore(config, runner or FakeRunner())


def req(rid, prompt, max_tokens=3) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), None, max_tokens)


def run(core) -> dict:
    finished = {}
    while core.has_unfinished_requests():
        for o in core.step():
            if o.finish_reason is not None:
                finished[o.req_id] = o
    return finished


def test_prompt_checks():
    core = make_core()
    core.check_prompt_token_ids([1, 2, 3])
    with pytest.raises(ValueError, match=r"prompt token id 100 is out of range \[0, 100\)"):
        core.check_prompt_token_ids([1, 100])
    with pytest.raises(ValueError, match="prompt is empty"):
        core.check_prompt_token_ids([])
    with pytest.raises(ValueError, match="your prompt has 64 tokens"):
        core.check_prompt_token_ids([1] * 64)
    with pytest.raises(ValueError, match="you requested 65 tokens"):
        core.add_request(req("long", [1] * 60, max_tokens=5))
    assert not core.has_unfinished_requests()


def test_steps_finish_with_a_reason_that_is_a_string():
    core = make_core()
    core.add_request(req("a", [1, 2, 3]))
    core.add_request(req("b", [4, 5, 6, 7, 8]))
    core.step()
    assert sorted(core.running_request_ids()) == ["a", "b"]
    assert not hasattr(core.runner, "idle_calls")
    done = run(core)
    assert core.runner.idle_calls == 1  # told once, when the last request finished (a replica then lends its cores)
    assert {rid: o.finish_reason for rid, o in done.items()} == {"a": "length", "b": "length"}
    assert done["a"].finish_reason is FinishReason.LENGTH
    assert json.dumps(done["a"].finish_reason) == '"length"' and f"{done['a'].finish_reason}" == "length"
    st = core.stats()
    assert (st.num_running, st.num_waiting, st.num_free_blocks) == (0, 0, 32)
    assert core.kv_state()["consistent"]


def test_a_failing_request_is_isolated():
    runner = FakeRunner()
    core = make_core(runner)
    core.add_request(req("good", [1, 2, 3]))
    core.add_request(req("bad", [1, POISON, 3]))
    done = run(core)
    assert done["bad"].finish_reason is FinishReason.ERROR and "RuntimeError: boom" in done["bad"].stop_reason
    assert done["good"].finish_reason == FinishReason.LENGTH
    assert ["good"] in runner.batches and ["bad"] in runner.batches  # re-run one at a time
    assert core.stats().num_free_blocks == 32


def test_a_fatal_error_stops_the_core():
    core = make_core(FakeRunner(fatal=True))
    core.add_request(req("bad", [POISON]))
    with pytest.raises(EngineFatalError):
        core.step()
    with pytest.raises(EngineFatalError):
        core.step()
    core.shutdown()
    assert core.runner.closed


def test_chunked_prefill_off_needs_a_budget_for_the_whole_context():
    with pytest.raises(ValueError, match="chunked prefill disabled"):
        make_core(enable_chunked_prefill=False, max_num_batched_tokens=32)


def test_default_step_budget():
    """No --max-num-batched-tokens: 2048 tokens per step, or at least the context length without chunked prefill
    (a whole prompt must fit one step); a given value stays."""
    def budget(max_model_len=8192, **options):
        return SchedulerConfig(**options).with_budget_for(max_model_len).max_num_batched_tokens

    assert SchedulerConfig().max_num_batched_tokens is None
    assert budget() == 2048 and budget(target_ttft_ms=500) == 2048
    assert budget(enable_chunked_prefill=False) == 8192 and budget(300, enable_chunked_prefill=False) == 2048
    assert budget(max_num_batched_tokens=96) == budget(max_num_batched_tokens=96, enable_chunked_prefill=False) == 96
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        SchedulerConfig(max_num_batched_tokens=0)
    # a scheduler built on its own (no engine core) sets it the same way
    sched = Scheduler(SchedulerConfig(enable_chunked_prefill=False), CacheConfig(block_size=4), KVCacheManager(8, 4),
                      4096)
    assert sched.token_budget == 4096


class LongRunner(FakeRunner):
    max_model_len = 4096
    num_blocks = 1200

    def __init__(self) -> None:
        super().__init__()
        self.step_tokens = []

    def execute(self, so) -> ModelRunnerOutput:
        self.step_tokens.append(so.num_batched_tokens)
        return super().execute(so)


@pytest.mark.parametrize("chunked, budget, steps", [(True, 2048, [2048, 952]), (False, 4096, [3000])])
def test_engine_core_sets_the_default_budget(chunked, budget, steps):
    """The core's scheduler runs the default budget: a 3,000-token prompt in chunks of 2,048, or whole when
    chunked prefill is off (the budget is then the context length, where 2,048 used to refuse to start)."""
    runner = LongRunner()
    core = make_core(runner, enable_chunked_prefill=chunked)
    assert core.config.scheduler.max_num_batched_tokens == core.stats().token_budget == budget
    core.add_request(req("long", [1] * 3000, max_tokens=1))
    run(core)
    assert runner.step_tokens == steps


def test_engine_core_imports_no_worker_or_torch():
    code = ("import sys, pagedllm.engine.core\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('pagedllm.worker')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
