import os

import kernel_builds
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
ALONE_MAX_TOKENS = 48  # the new tokens of each prompt in ``greedy_alone``


@pytest.fixture(scope="session")
def llm():
    from pagedllm import LLM

    return LLM(dtype="float32")


@pytest.fixture(scope="session")
def greedy_alone(llm):
    """prompt -> its ``RequestOutput``: each of ``PROMPTS`` alone through the float32 engine, greedy,
    ``ALONE_MAX_TOKENS`` new tokens with their top-5 logprobs (which leave the tokens as they are). test_hf_reference
    checks them against transformers; the engine paths that must give a request its tokens alone (chunked prefill,
    preemption, swap) compare with them. One sequence of single-request steps per run (~19 s on 2 cores) instead of
    one per module."""
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=ALONE_MAX_TOKENS, logprobs=5)
    return {p: llm.generate(p, sp, use_tqdm=False)[0] for p in PROMPTS}


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
    """(prompt, max_new_tokens, ours: our new token ids) -> transformers' greedy decoding of the prompt, followed
    along ``ours``: (its new token ids, per-step log-softmax rows as tensors). One forward pass over the prompt and
    ``ours`` gives each step's row after the same tokens as ours: while ours agree with its choices (each row's
    argmax) they are its greedy output, and at the first difference its row is the one greedy decoding has there
    (the tokens before being the same); nothing after a difference is compared. It ends at the first token in
    ``generation_config.eos_token_id`` or after ``max_new_tokens``, as ``generate(do_sample=False)`` does: the same
    check as running ``generate`` (48 single-token steps a prompt, ~3 s each on 2 cores) in one pass."""
    import torch

    tok, model = hf_model
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, (list, tuple)) else set() if eos is None else {eos}
    cache = {}

    def run(prompt: str, max_new_tokens: int, ours: list[int]):
        ours = list(ours)[:max_new_tokens]
        key = (prompt, max_new_tokens, tuple(ours))
        if key not in cache:
            ids = tok(prompt, return_tensors="pt").input_ids
            seq = torch.cat([ids, torch.tensor([ours], dtype=ids.dtype)], dim=1)
            with torch.inference_mode():
                logits = model(seq).logits[0, ids.shape[1] - 1:]  # row i predicts new token i: len(ours) + 1 rows
            rows = [torch.log_softmax(l.float(), dim=-1) for l in logits]
            new = [int(r.argmax()) for r in rows]
            n = min(max_new_tokens, len(new))  # ours cut short (no end token) leaves the reference longer: a failure
            n = next((i + 1 for i, t in enumerate(new[:n]) if t in eos), n)
            cache[key] = (new[:n], rows[:n])
        return cache[key]

    return run


# ------------------------------------------------------------------ the kernels' other-target builds, in the background
_BUILDS = pytest.StashKey[dict]()


def _build_tests(items) -> list:
    return [i for i in items if getattr(i, "originalname", None) in kernel_builds.TESTS]


def pytest_collection_modifyitems(config, items):
    """The tests of the background builds (kernel_builds) run last: the builds then have had the whole run's idle
    cycles."""
    late = _build_tests(items)
    if late:
        items[:] = [i for i in items if i not in late] + late


def pytest_collection_finish(session):
    """Starts the builds that the collected tests read (none for a run that selects neither test, as a level's own
    run does, or for ``--collect-only``)."""
    import tempfile
    from pathlib import Path

    items = _build_tests(session.items)
    if not items or session.config.option.collectonly:
        return

    def picked(name: str) -> list[str]:  # each selected test's one parameter: its level (march) or ARM target
        return [next(iter(i.callspec.params.values())) for i in items if i.originalname == name]

    base = Path(tempfile.mkdtemp(prefix="pagedllm-kernel-builds-"))
    session.config.stash[_BUILDS] = {"base": base, "runs": {}}  # before any start: sessionfinish stops them
    kernel_builds.start(base, session.config.stash[_BUILDS]["runs"], levels=picked(kernel_builds.TESTS[0]),
                        arm=picked(kernel_builds.TESTS[1]))


def pytest_sessionfinish(session):
    import shutil

    builds = session.config.stash.get(_BUILDS, None)
    if builds is not None:
        kernel_builds.stop(builds["runs"])
        shutil.rmtree(builds["base"], ignore_errors=True)


@pytest.fixture(scope="session")
def kernel_builds_runs(request):
    """(kind, target) -> a background build (see kernel_builds.start), started once the run was collected."""
    return request.config.stash[_BUILDS]["runs"]
