"""Sampling parameters of one request (tier 0). Every bad value raises ValueError naming the parameter."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Range:
    """The allowed values of a numeric parameter (``high`` None: unbounded). One table serves the checks below
    and the server's OpenAPI schema."""

    low: float
    high: float | None
    low_inclusive: bool = True
    integer: bool = False

    def contains(self, v) -> bool:
        if self.integer and (not isinstance(v, int) or isinstance(v, bool)):
            return False
        above = v >= self.low if self.low_inclusive else v > self.low
        return above and (self.high is None or v <= self.high)

    def describe(self) -> str:
        if self.high is None:
            return f"an integer >= {self.low}" if self.integer else f">= {self.low}"
        lo = "[" if self.low_inclusive else "("
        text = f"in {lo}{self.low:g}, {self.high:g}]"
        return f"an integer {text}" if self.integer else text

    def json_schema(self) -> dict:
        out = {"type": "integer" if self.integer else "number"}
        out["minimum" if self.low_inclusive else "exclusiveMinimum"] = self.low
        if self.high is not None:
            out["maximum"] = self.high
        return out


RANGES: dict[str, Range] = {
    "n": Range(1, 64, integer=True),
    "temperature": Range(0.0, 100.0),
    "top_p": Range(0.0, 1.0, low_inclusive=False),
    "top_k": Range(-1, None, integer=True),
    "min_p": Range(0.0, 1.0),
    "repetition_penalty": Range(0.0, 2.0, low_inclusive=False),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "max_tokens": Range(1, None, integer=True),
    "min_tokens": Range(0, None, integer=True),
    "logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "prompt_logprobs": Range(0, MAX_LOGPROBS, integer=True),
}

POOLING = ("last", "mean", "cls")  # the last token's hidden state, the mean over the prompt, the first token's


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text (exactly one of the fields): a JSON schema, any JSON object, a regular
    expression, one of several strings, or a grammar (Lark, or llama.cpp's GBNF / EBNF).

    ``after``: the constraint applies only to the output that follows the first occurrence of this text in it (a
    reasoning model's ``</think>``: the reasoning before it is free); the token that completes it is the last free
    one. Set by the server's reasoning parser, not a client field."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    after: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured outputs json: not valid JSON ({e})") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured outputs json must be a JSON schema (an object or its JSON text)")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured outputs {name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured outputs choice must be a non-empty list of strings")
        if self.after is not None and (not isinstance(self.after, str) or not self.after):
            raise ValueError("structured outputs after must be a non-empty string")

    @staticmethod
    def from_dict(d: "dict | StructuredOutputsParams") -> "StructuredOutputsParams":
        """From vLLM's ``structured_outputs`` / ``guided_decoding`` object (unknown keys are an error)."""
        if isinstance(d, StructuredOutputsParams):
            return d
        if not isinstance(d, dict):
            raise ValueError("structured outputs must be an object")
        known = {"json", "json_object", "regex", "choice", "grammar"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unsupported structured outputs field(s) {unknown}; supported: {sorted(known)}")
        return StructuredOutputsParams(**d)

    def key(self) -> tuple[str, str]:
        """(llguidance grammar format, text): what the grammar compiles from, and its cache key."""
        if self.json_object:
            return "json_schema", '{"type": "object"}'
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return "json_schema", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar


# Every stop string is searched in the new text of every step and the longest one sets how much streamed text is held
# back, so a request with very many or very long ones would slow the steps it shares with others. OpenAI takes 4
# strings; these bounds leave room for programs that pass more.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives returned per token (0: just the chosen token)
    # logprob of each prompt token after the ones before it, and that many top alternatives (vLLM's); such a
    # request computes its whole prompt (no prefix-cache hits)
    prompt_logprobs: int | None = None
    # an embedding request: no token is sampled; the model's final hidden states are pooled (``POOLING``) and
    # returned
    pooling: str | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | dict | None = None  # constrained decoding (a dict: its fields)
    guided_decoding: StructuredOutputsParams | dict | None = None  # vLLM's older name for the same
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        so = self.structured_outputs
        if self.guided_decoding is not None:
            if so is not None:
                raise ValueError("give structured_outputs or guided_decoding, not both")
            so = self.guided_decoding
            object.__setattr__(self, "guided_decoding", None)
        if so is not None:
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_dict(so))
        def bad(name: str, limit: str, value: object) -> ValueError:
            return ValueError(f"{name} must be {limit}, got {value!r}")

        for name, r in RANGES.items():
            v = getattr(self, name)
            if v is None and name in ("max_tokens", "logprobs", "prompt_logprobs"):
                continue
            if not r.contains(v):
                raise bad(name, r.describe(), v)
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", "a 64-bit integer", self.seed)
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or tok < 0:
                    raise bad("logit_bias key", "a non-negative token id", tok)
                if not -100.0 <= bias <= 100.0:
                    raise bad(f"logit_bias[{tok}]", "in [-100, 100]", bias)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.pooling is not None:
            if self.pooling not in POOLING:
                raise bad("pooling", f"one of {list(POOLING)}", self.pooling)
            if self.n != 1 or self.logprobs is not None or self.structured_outputs is not None:
                raise ValueError("an embedding (pooling) request samples nothing: n, logprobs and structured "
                                 "outputs do not apply")
        if self.stop_token_ids is not None:
            for t in self.stop_token_ids:
                if not isinstance(t, int) or t < 0:
                    raise bad("stop_token_ids", "non-negative token ids", t)
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise bad("stop", "non-empty strings", s)
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string must be at most {MAX_STOP_CHARS} characters, got one of {len(s)}")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", list(self.logit_bias or {})), ("stop_token_ids", self.stop_token_ids or [])):
            for t in ids:
                if t >= vocab_size:
                    raise ValueError(f"{name} token id must be < vocab size {vocab_size}, got {t}")
