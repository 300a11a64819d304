"""The offline entry point: ``LLM().generate(prompts, params)``, ``LLM().chat(messages, params)`` and
``LLM().embed(prompts)``."""

from __future__ import annotations

from pagedllm.engine.llm_engine import LLMEngine, PromptType, as_prompt_list, build_config
from pagedllm.outputs import RequestOutput, l2_normalize
from pagedllm.sampling_params import SamplingParams


class LLM:
    """Loads a model (the embedded SmolLM2-135M-Instruct when ``model`` is None) and generates offline.

    Keyword arguments are those of ``build_config`` (dtype, max_model_len, block_size, kv_cache_memory,
    enable_prefix_caching, max_num_batched_tokens, max_num_seqs, device, ...).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(build_config(model, **kwargs))

    @classmethod
    def from_engine_config(cls, config) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self, prompts: PromptType | list[PromptType], sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True, priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        return self._run([self.engine.encode_prompt(p) for p in as_prompt_list(prompts)], sampling_params, use_tqdm,
                         priority)

    def embed(self, prompts: PromptType | list[PromptType], pooling: str | None = None, normalize: bool = True,
              use_tqdm: bool = True, prompt_name: str | None = None,
              truncate_prompt_tokens: int | None = None) -> list[RequestOutput]:
        """Embeddings: each prompt's final hidden states pooled (``last`` token, ``mean`` or ``cls``: the first
        token; None: the engine's default: an embedding model's own), through the model's Dense layers if it has
        them, L2-normalised unless ``normalize`` is False; in each output's ``embedding``. ``prompt_name``: one of
        the model's prompts (EmbeddingGemma's ``query`` / ``document``) before each text;
        ``truncate_prompt_tokens``: cut longer inputs to this many tokens (-1: the model's maximum)."""
        params = SamplingParams(max_tokens=1, pooling=pooling or self.engine.default_pooling)
        encoded = [self.engine.encode_for_embedding(p, prompt_name, truncate_prompt_tokens)
                   for p in as_prompt_list(prompts)]
        outs = self._run(encoded, params, use_tqdm, None)
        if normalize:
            for o in outs:
                o.embedding = l2_normalize(o.embedding)
        return outs

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True, chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([self.engine.encode_chat(c, template_kwargs=chat_template_kwargs) for c in conversations],
                         sampling_params, use_tqdm, None)

    def _run(self, encoded, sampling_params, use_tqdm, priority) -> list[RequestOutput]:
        n = len(encoded)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        ids = []
        try:
            for i, ((text, toks), sp) in enumerate(zip(encoded, params)):
                rid = self.engine.new_request_id()
                self.engine.add_tokenized_request(rid, text, toks, sp, priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * n
        bar = None
        if use_tqdm and n > 1:
            from tqdm import tqdm

            bar = tqdm(total=n, desc="Generating", unit="req", dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]
