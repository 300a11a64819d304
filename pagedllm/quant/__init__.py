"""Quantized weights at run time: formats and round-to-nearest (``formats``), per-layer-type policies
(``policy``), the packed linear kernels (``linear``) and the on-disk checkpoint format (``checkpoint``). Below the
model: nothing here imports ``pagedllm.model``. Making checkpoints (AWQ, GPTQ, calibration) is ``pagedllm.quantize``."""
