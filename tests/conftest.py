import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _suite_cache_dir() -> str:
    """The suite runs on its own cache directory, as a fresh machine would: no quality-gate verdicts
    (``activation_bits.json``: they switch ``--activation-bits auto`` / ``--large-step-weights auto``) and no weight
    plan (``autotune.json``) from this machine's earlier runs; the caches that only save work and are keyed by the
    file (tokenizers, HF reference checkpoints, fetched models) are linked from the user's cache directory."""
    import atexit
    import shutil
    import tempfile

    from pagedllm.config import cache_dir

    user = cache_dir()
    suite = tempfile.mkdtemp(prefix="pagedllm-suite-cache-")
    for name in ("tokenizers", "hf_reference", "models"):
        os.makedirs(os.path.join(user, name), exist_ok=True)
        os.symlink(os.path.join(user, name), os.path.join(suite, name))
    atexit.register(shutil.rmtree, suite, ignore_errors=True)  # removes the links, not what they point to
    return suite


os.environ["PAGEDLLM_CACHE_DIR"] = _suite_cache_dir()

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Translate to French: I like apples and oranges.",
    "Q: What is 17 multiplied by 3?\nA:",
    "The three primary colors are",
    "<|im_start|>user\nWrite a haiku about autumn leaves.<|im_end|>\n<|im_start|>assistant\n",
    "List of the planets of the solar system, in order from the sun: 1.",
]


@pytest.fixture(scope="session")
def llm():
    from pagedllm import LLM

    return LLM(dtype="float32")


@pytest.fixture(scope="session")
def llm_nocache():
    """The float32 engine without prefix caching: the reference for cached paths, and an engine whose every
    request computes its whole prompt. Shared by the tests that only run requests on it (none changes it)."""
    from pagedllm import LLM

    return LLM(dtype="float32", enable_prefix_caching=False)


@pytest.fixture(scope="session")
def hf_model():
    """The HuggingFace transformers reference: transformers' own loading of the same GGUF file (its conversion
    cached as a checkpoint folder after the first time, see ``pagedllm.reference.hf``)."""
    from pagedllm.reference.hf import load_hf_reference

    return load_hf_reference("float32")


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """prompt -> (new token ids, per-step log-softmax rows as tensors), greedy, one prompt at a time."""
    import torch

    tok, model = hf_model
    cache = {}

    def run(prompt: str, max_new_tokens: int):
        key = (prompt, max_new_tokens)
        if key not in cache:
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                     return_dict_in_generate=True, output_logits=True,
                                     pad_token_id=tok.eos_token_id)
            new = out.sequences[0, ids.shape[1]:].tolist()
            logprobs = [torch.log_softmax(l[0].float(), dim=-1) for l in out.logits]
            cache[key] = (new, logprobs)
        return cache[key]

    return run
