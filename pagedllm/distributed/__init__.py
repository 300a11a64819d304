"""Tensor parallelism over torch.distributed: the process group (``group``), starting and watching the ranks
(``launcher``) and Megatron-style weight sharding (``sharding``). Below the worker: the loop of ranks > 0 is
``pagedllm.worker.tp_worker``, which this package starts as a process but never imports."""
