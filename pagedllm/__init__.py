"""pagedllm: an LLM inference serving engine with a paged KV cache and continuous batching."""

__version__ = "0.1.0"

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name):  # LLM pulls in torch: import it only when asked for
    if name == "LLM":
        from pagedllm.engine.llm import LLM

        return LLM
    raise AttributeError(name)
