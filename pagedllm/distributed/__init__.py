"""Tensor parallelism over torch.distributed: the process group (``group``), starting and watching the ranks
(``launcher``), Megatron-style weight sharding (``sharding``) and the loop of ranks > 0 (``worker``)."""
