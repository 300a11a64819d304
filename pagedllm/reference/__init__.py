"""Independent references the engine is checked against: ``hf.py``, HuggingFace transformers' own reading of a GGUF
file (the benchmarks' HF baselines, the HF-identity tests, the eval tools). Stdlib and layer 0 only at import time;
torch and transformers are imported when a reference is loaded."""
