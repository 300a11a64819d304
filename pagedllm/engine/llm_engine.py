"""LLMEngine: tokenizer + EngineCore + OutputProcessor, stepped by its caller (the offline ``LLM`` or the async
front end's background loop)."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

from pagedllm.config import EngineConfig, resolve_model_path
from pagedllm.engine.core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.tokenizer import import_tokenizer_library, load_tokenizer, text_encoder
from pagedllm.outputs import IterationStats, KVCacheSpec, RequestOutput, SchedulerStats
from pagedllm.sample.structured import StructuredOutputs
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.heap import release_freed_memory
from pagedllm.worker.model_runner import ModelRunner

PromptType = str | list[int] | dict


def _tokenizer_then_trim(path: str):
    """The tokenizer, then the memory its load freed handed back (worker.heap) while the weights still pack: the
    start's peak memory (Gemma 3's 262k-token vocabulary: ~180 MiB of it)."""
    tokenizer = load_tokenizer(path)
    release_freed_memory()
    return tokenizer


def as_prompt_list(prompts: PromptType | list[PromptType]) -> list[PromptType]:
    """One prompt (a text, a list of token ids, a dict) as a list of one; a list of prompts as a list."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        return [prompts]
    return list(prompts)


def build_config(model: str | None = None, **options) -> EngineConfig:
    """An ``EngineConfig`` from options by name: the fields of the config dataclasses (``pagedllm.config``), e.g.
    ``dtype``, ``max_model_len``, ``block_size``, ``kv_cache_memory``, ``enable_prefix_caching``,
    ``max_num_batched_tokens``, ``max_num_seqs``, ``scheduling_policy``, ``speculative_config``, ``device`` (each
    also a flag: ``pagedllm serve --help``). An unknown name raises TypeError."""
    return EngineConfig.from_options(model=model, **options)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # the tokenizer loads on a thread while the weights do (a first start builds it from a GGUF file's
        # vocabulary and saves it: about a second for 150k tokens, in a start-up of five)
        import_tokenizer_library()
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
            tokenizer = pool.submit(_tokenizer_then_trim, resolve_model_path(config.model.model))
            runner = ModelRunner(config)
            try:
                self.core = EngineCore(config, runner)
                self.tokenizer = tokenizer.result()
            except BaseException:
                runner.shutdown()  # e.g. the config does not fit the model: stop the other tensor-parallel ranks
                raise
        release_freed_memory()  # what the weights' packing freed (worker.heap)
        self.config = self.core.config  # the step budget set
        self._encode = text_encoder(self.tokenizer)
        self.model_path = runner.model_path
        self.max_model_len = self.core.max_model_len
        eos = runner.arch.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos
        # embeddings: --pooling, else the file's, else the last token's (a causal model's whole-prompt summary)
        self.default_pooling = config.model.pooling or runner.arch.pooling or "last"
        # an embedding model (an encoder): it serves vectors only; its sentence-transformers modules (prompts,
        # Normalize, Matryoshka sizes) when its folder has them
        self.is_embedding_model = runner.arch.encoder
        self.sentence = runner.sentence
        self.output_processor = OutputProcessor(self.tokenizer, eos, self.max_model_len, runner.arch.stop_token_ids)
        self._ids = itertools.count()
        self.last_iteration_stats = IterationStats()
        # device, dtype, weight format, kernel path, weight plan, step token budget
        self.runtime = {**runner.describe(), "max_num_batched_tokens": self.config.scheduler.max_num_batched_tokens}
        self._structured: StructuredOutputs | None = None

    @property
    def structured(self) -> StructuredOutputs:
        """Grammar compiler for constrained requests, made on the first one (about 0.6 s: llguidance reads the
        vocabulary) and shared with the model runner."""
        if self._structured is None:
            self._structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_id)
            self.runner.structured = self._structured
        return self._structured

    # ------------------------------------------------------------------ prompts
    @staticmethod
    def _check_text(text: str) -> None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the prompt is not valid Unicode text ({e.reason} at character {e.start})") from None

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._check_text(text)
        return self._encode(text, add_special_tokens=add_special_tokens)

    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.encode_text(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self.encode_prompt(prompt["prompt"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def encode_for_embedding(self, prompt: PromptType, prompt_name: str | None = None,
                             truncate: int | None = None) -> tuple[str | None, list[int]]:
        """An embedding input as sentence-transformers encodes it: the model's prompt ``prompt_name`` (else its
        default prompt) before a text, then the tokenizer with its special tokens; ``truncate`` (-1: the model's
        maximum length) cuts a longer input as the tokenizer truncates (its special tokens kept). ValueError
        names an unknown prompt name."""
        prompts = self.sentence.prompts if self.sentence is not None else {}
        name = prompt_name if prompt_name is not None else (self.sentence.default_prompt_name if self.sentence else None)
        if name is not None and name not in prompts:
            raise ValueError(f"unknown prompt_name {name!r}; this model's prompts: {sorted(prompts) or 'none'}")
        limit = None if truncate is None else (self.max_model_len if truncate < 0 else min(truncate, self.max_model_len))
        if limit is not None and limit < 1:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1")
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            text, ids = self.encode_prompt(prompt)
            return text, ids if limit is None else ids[:limit]
        text = prompts.get(name, "") + prompt
        if limit is None:
            return text, self.encode_text(text)
        self._check_text(text)
        return text, self.tokenizer(text, truncation=True, max_length=limit)["input_ids"]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """``template_kwargs``: extra variables for the template (vLLM's ``chat_template_kwargs``, e.g. Qwen 3's
        ``enable_thinking``)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        reserved = set(template_kwargs or ()) & {"messages", "tools", "tokenize", "add_generation_prompt",
                                                 "conversation", "chat_template", "return_dict"}
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools or None,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **(template_kwargs or {}))
        except Exception as e:  # jinja errors (a template raising on an unexpected message) are bad input
            raise ValueError(f"the chat template cannot render these messages: {e}") from None

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        text = self.apply_chat_template(messages, tools=tools, template_kwargs=template_kwargs)
        return text, self.encode_text(text, add_special_tokens=False)

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self, request_id: str | None, prompt: PromptType, params: SamplingParams, priority: int = 0,
        arrival_time: float | None = None,
    ) -> str:
        """Tokenize, validate and queue one request; raises ValueError (and queues nothing) on bad input."""
        request_id = request_id or self.new_request_id()
        text, ids = self.encode_prompt(prompt)
        return self.add_tokenized_request(request_id, text, ids, params, priority, arrival_time)

    def add_tokenized_request(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                              priority: int = 0, arrival_time: float | None = None,
                              max_queue_delay_ms: float | None = None) -> str:
        self.core.check_prompt_token_ids(ids)
        if params.structured_outputs is not None:
            self.structured.grammar(params.structured_outputs)  # compiles (cached) or raises ValueError -> 400
        parent, reqs = self.output_processor.make_requests(request_id, text, ids, params, priority, arrival_time)
        for r in reqs:
            r.max_queue_delay_ms = max_queue_delay_ms
        added = []
        try:
            for r in reqs:
                self.core.add_request(r)
                added.append(r.request_id)
        except Exception:
            self.core.abort_requests(added)
            raise
        self.output_processor.register(parent, reqs)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        out, child_ids = self.output_processor.abort(request_id)
        self.core.abort_requests(child_ids)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def unfinished_request_ids(self) -> list[str]:
        """The user requests not finished yet (ids of add_request)."""
        return list(self.output_processor.parents)

    def has_request(self, request_id: str) -> bool:
        """The user request is not finished yet."""
        return request_id in self.output_processor.parents

    def request_ids_of(self, core_request_ids) -> set[str]:
        """The user requests that these core requests (a request's samples, n > 1) belong to, if still tracked."""
        children = self.output_processor.children
        return {children[c].parent.request_id for c in core_request_ids if c in children}

    # ------------------------------------------------------------------ state
    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def running_request_ids(self) -> list[str]:
        """The core requests running now (those a step computes)."""
        return self.core.running_request_ids()

    def kv_state(self) -> dict:
        """The KV block pools now (see Scheduler.kv_state), with the KV bytes each running request holds (a
        sliding-window group counts only the blocks inside its window)."""
        state = self.core.kv_state()
        bpb = self.runner.bytes_per_block
        state["kv_bytes_per_request"] = {rid: n * bpb for rid, n in state.pop("blocks_per_request").items()}
        state["kv_layer_groups"] = len(self.runner.kv_group_windows)
        if "state_slots" in state:  # the bytes of one sequence's recurrent states (all linear layers)
            state["state_slots"]["bytes_per_slot"] = self.runner.kv.state_bytes_per_slot
        return state

    def drain_aborted_stats(self) -> IterationStats:
        """Statistics of aborts not yet reported (when no step runs to carry them)."""
        return self.output_processor.drain_aborted_stats()

    def set_forward_section(self, section) -> None:
        """A context manager factory entered around each forward pass (AsyncLLM releases its lock there)."""
        self.core.forward_section = section

    # ------------------------------------------------------------------ what the layers above may ask
    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def runner(self):
        """The model runner, for tools that measure the model itself (eval's perplexity, bench roofline/tp).
        Serving code uses the accessors below instead."""
        return self.core.runner

    def kv_cache_spec(self) -> KVCacheSpec:
        r = self.runner
        return KVCacheSpec(num_blocks=r.num_blocks, block_size=r.block_size, bytes_per_block=r.bytes_per_block,
                           total_bytes=r.kv_cache_bytes, num_groups=len(r.kv_group_windows))

    def add_tp_failure_callback(self, callback) -> bool:
        """Call ``callback(message)`` when a tensor-parallel rank fails; False (nothing registered) without TP."""
        tp = self.runner.tp
        if tp is None:
            return False
        tp.add_failure_callback(callback)
        return True

    def inject_forward_fault(self, token_id: int | None) -> None:
        """Reliability tests: the forward pass raises whenever its batch holds this token id."""
        self.runner.inject_forward_fault(token_id)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (the engine cannot step afterwards)."""
        self.core.shutdown()

    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        outputs, to_abort, self.last_iteration_stats = self.output_processor.process(core_outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        self.last_iteration_stats.kv_events = self.core.kv_cache_manager.pool.take_events()
        return outputs
