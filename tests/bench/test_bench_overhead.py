"""`bench overhead`'s classification of py-spy samples (the live run is a benchmark command, not a test)."""

import pytest

from pagedllm.bench.overhead import classify, format_table, parse_raw, summarize

ENGINE = "process 1:\"python\";thread (0x1);_bootstrap (threading.py);_main (pagedllm/engine/async_engine.py);" \
         "_run (pagedllm/engine/async_engine.py)"
STEP = ENGINE + ";_step_locked (pagedllm/engine/async_engine.py);step (pagedllm/engine/core.py)"
HTTP = "process 1:\"python\";thread (0x2);<module> (uvicorn/main.py);run_forever (asyncio/base_events.py)"

RAW = "\n".join([
    f"{STEP};execute (pagedllm/worker/model_runner.py);_forward_fused (pagedllm/model/llama.py) 80",
    f"{STEP};execute (pagedllm/worker/model_runner.py);__call__ (pagedllm/sample/sampler.py) 4",
    f"{STEP};execute (pagedllm/worker/model_runner.py);_step_tensors (pagedllm/worker/model_runner.py) 3",
    f"{STEP};schedule (pagedllm/core/scheduler.py) 5",
    f"{STEP};step (pagedllm/engine/llm_engine.py);process (pagedllm/engine/output_processor.py) 6",
    f"{STEP};update_stats (pagedllm/engine/async_engine.py) 2",
    f"{ENGINE};wait (threading.py) 50",
    f"{HTTP};_run_once (asyncio/base_events.py);select (selectors.py) 70",
    f"{HTTP};_run_once (asyncio/base_events.py);lines (pagedllm/server/streaming.py) 10",
    # uvloop's event loop is C: waiting in it, the runner that called it is the innermost Python frame
    "process 1:\"python\";thread (0x2);main (uvicorn/main.py);asyncio_run (uvicorn/_compat.py);"
    "Runner.run (asyncio/runners.py) 30",
    "process 1:\"python\";thread (0x3);_worker (concurrent/futures/thread.py) 9",
    "",
])


def test_classify_and_summarize():
    counts = classify(parse_raw(RAW))
    assert counts == {"model forward": 80, "sampling": 4, "input preparation": 3, "scheduling": 5,
                      "output processing": 6, "engine loop other": 2, "engine waiting": 50, "HTTP idle": 100,
                      "HTTP busy": 10, "other threads": 9}
    s = summarize(counts)
    assert s["in_step_samples"] == 100
    assert s["shares"]["model forward"] == pytest.approx(0.8)
    # 20% of the step outside the forward pass, plus HTTP busy 10 samples per 100 in-step samples
    assert s["engine_overhead"] == pytest.approx(0.3)
    assert "**30.0%**" in format_table(s)


def test_no_step_samples_is_an_error():
    with pytest.raises(ValueError, match="no sample of the engine inside a step"):
        summarize(classify(parse_raw(f"{ENGINE};wait (threading.py) 5\n")))
