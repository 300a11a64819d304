"""`pagedllm simulate`: predict a deployment's throughput and latency without the hardware.

The real scheduler and KV cache manager of ``pagedllm.core`` decide every step (chunked prefill, token budget,
max_num_seqs, preemption, prefix-cache hits, speculative lookahead); a roofline cost model prices each step from
the exact mix of prefill chunks and decodes the scheduler produced, on a virtual clock. Pure Python: nothing in
this package imports torch.

Modules, one job each:
- ``hardware``: GPU profiles (datasheet peaks) and the profile type; ``calibrate``: a CPU profile from
  ``pagedllm bench roofline``'s JSON;
- ``model_profile``: model shapes (presets, HF ``config.json``, GGUF header) and weight bytes per quantization;
- ``kvcalc``: KV cache bytes with grouped-query attention vs the common formula that ignores it;
- ``cost``: the per-step roofline cost model and the memory plan (KV capacity);
- ``trace``: request traces (Poisson, burst, closed loop, recorded JSON, the W1 workload);
- ``simulator``: the event loop around the real scheduler; ``naive``: static batching with max-length KV
  reservation (simulated directly);
- ``metrics``: summaries (mean / p99, cost per million tokens); ``ladder``: the optimization ladder;
  ``validate``: the calibrated CPU profile against measured ``bench serve`` runs; ``cli``: the command.
"""
