"""`pagedllm quantize`: making quantized checkpoints offline (calibration, AWQ, GPTQ, round to nearest). Above the
model (it runs the full-precision model on calibration text); the run-time formats and kernels are
``pagedllm.quant``."""
