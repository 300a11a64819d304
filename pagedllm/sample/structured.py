"""Constrained decoding with llguidance: a grammar per request, a token mask per step.

``StructuredOutputs`` turns a request's ``StructuredOutputsParams`` into an llguidance grammar (compiled once per
distinct constraint: an LRU cache keyed by the constraint's text), checks it at admission (a grammar that does not
compile is a ValueError naming the problem, which the server returns as 400), and makes one ``LLMatcher`` per
request. The model runner keeps each request's matcher in step with its output tokens (consuming new ones, rolling
back ones the scheduler dropped), asks every constrained row of a step for its allowed-token bitmask (a request
verifying speculative drafts: one row per draft, each masked by the grammar's state after the drafts before it),
and the sampler masks those rows' logits in one batched operation. Drafts are proposed only as far as the grammar
accepts them.

A constraint with ``after`` (a reasoning model's ``</think>``, set by the server's reasoning parser) leaves the output
free until that text has appeared in it: the runner decodes each new token's bytes and looks for it, and the grammar
starts at the token after the one that completes it. While it waits, a request's drafts stop before one that would
complete the text, so that every row after it in a step is masked.

llguidance was chosen over xgrammar here: it has no torch (or triton) dependency, ships a CPU wheel for every
platform, and computes a mask for this 49,152-token vocabulary in tens of microseconds (``bench serve
--structured`` measures the end-to-end cost).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import llguidance
import torch

from pagedllm.sample.metadata import CachedRequestState
from pagedllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 256


class StructuredOutputs:
    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self.vocab_size = vocab_size
        import llguidance.hf  # imports transformers (~0.5 s): not on a start-up's path, only a first constraint's

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
        self._grammars: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.hits = self.misses = 0

    def grammar(self, so: StructuredOutputsParams) -> str:
        """The llguidance grammar of ``so`` (cached); ValueError naming the problem when it does not compile."""
        key = so.key()
        g = self._grammars.get(key)
        if g is not None:
            self.hits += 1
            self._grammars.move_to_end(key)
            return g
        self.misses += 1
        kind, text = key
        try:
            g = llguidance.grammar_from(kind, text)
        except Exception as e:  # llguidance raises ValueError or its own errors for bad schemas/regexes
            raise ValueError(f"invalid {_label(kind)}: {e}") from None
        ok, err = _validate(g, self.tokenizer)
        if not ok:
            raise ValueError(f"invalid {_label(kind)}: {err}")
        self._grammars[key] = g
        if len(self._grammars) > GRAMMAR_CACHE_SIZE:
            self._grammars.popitem(last=False)
        return g

    def find_after(self, tokens: list[int], text: str, start: int) -> int | None:
        """One past the token that completes the first ``text`` in the bytes of ``tokens`` (None: no token does),
        given that none of ``tokens[:start]`` does. A token holds at least one byte, so the text's beginning lies
        in the last ``len(text)`` tokens before ``start`` or later."""
        tag = text.encode()
        buf = self.tokenizer.decode_bytes(tokens[max(0, start - len(tag)):start])
        for i in range(start, len(tokens)):
            buf += self.tokenizer.decode_bytes(tokens[i:i + 1])
            if tag in buf:
                return i + 1
        return None

    def matcher(self, so: StructuredOutputsParams) -> "llguidance.LLMatcher":
        m = llguidance.LLMatcher(self.tokenizer, self.grammar(so), log_level=0)
        if m.is_error():
            raise ValueError(f"invalid {_label(so.key()[0])}: {m.get_error()}")
        return m


def _label(kind: str) -> str:
    return {"json_schema": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}[kind]


def _validate(grammar: str, tokenizer) -> tuple[bool, str]:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    return not is_error, "; ".join(str(m).strip() for m in messages)


def fill_bitmasks(matchers: list, vocab_size: int) -> torch.Tensor:
    """(len(matchers), ceil(vocab/32)) int32 bitmasks of the tokens each matcher allows next."""
    masks = torch.zeros((len(matchers), (vocab_size + 31) // 32), dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.unsafe_compute_mask_ptr(masks[i].data_ptr(), masks.shape[1] * 4)
    return masks


def unpack_bitmasks(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmasks -> (rows, vocab) bool: token t allowed where bit t % 32 of word t // 32 is set."""
    bits = (masks.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=masks.device)) & 1
    return bits.bool().reshape(masks.shape[0], -1)[:, :vocab_size]


def grammar_start(st: CachedRequestState, structured: StructuredOutputs) -> int | None:
    """The first output token the request's grammar constrains: 0, or for a constraint with ``after`` the token
    after the one that completes that text (None while none has)."""
    after = st.sampling_params.structured_outputs.after
    if after is None:
        return 0
    out = st.output_token_ids
    if st.grammar_from is not None and st.grammar_from > len(out):  # the tokens that completed it were dropped
        st.grammar_from, st.matcher = None, None
    if st.grammar_from is None:
        st.grammar_from = structured.find_after(out, after, min(st.scanned, len(out)))
        st.scanned = len(out)
    return st.grammar_from


def sync_matcher(st: CachedRequestState, structured: StructuredOutputs):
    """The request's grammar matcher, made on first use and brought in step with its output tokens (new ones
    consumed; ones the scheduler dropped, e.g. rejected drafts, rolled back); None while its constraint waits for
    its ``after`` text."""
    start = grammar_start(st, structured)
    if start is None:
        return None
    if st.matcher is None:
        st.matcher = structured.matcher(st.sampling_params.structured_outputs)
        st.consumed = start
    n = len(st.output_token_ids)
    if st.consumed > n:
        st.matcher.rollback(st.consumed - n)
    elif st.consumed < n:
        for t in st.output_token_ids[st.consumed :]:
            if not st.matcher.consume_token(t):
                logger.warning("request %s: token %d is outside its grammar (%s)", st.req_id, t,
                               st.matcher.get_error())
                break
    st.consumed = n
    return st.matcher


def constrain_drafts(st: CachedRequestState, drafts: list[int], structured: StructuredOutputs) -> None:
    """Cut a constrained request's ``drafts`` (in place) to those its grammar accepts; while the grammar waits for
    its ``after`` text, to those before the draft that would complete it (the row after that one must be masked,
    and its grammar state is not known yet)."""
    so = st.sampling_params.structured_outputs
    if so is None or not drafts:
        return
    m = sync_matcher(st, structured)
    if m is None:
        n = len(st.output_token_ids)
        end = structured.find_after(st.output_token_ids + drafts, so.after, n)
        if end is not None:
            del drafts[end - 1 - n:]
        return
    ok = m.try_consume_tokens(drafts)
    m.rollback(ok)
    del drafts[ok:]


def grammar_masks(groups, requests: dict[str, CachedRequestState], structured: StructuredOutputs, vocab: int,
                  device: torch.device):
    """(rows, allowed) for the step's constrained requests, or None. A request verifying k drafts has k+1
    rows: row i is masked by its grammar's state after drafts[:i] (the drafts are consumed for this and
    rolled back; the tokens the verification accepts are consumed after sampling)."""
    rows, masks = [], []
    for s, first, n in groups:
        st = requests[s.req_id]
        if st.sampling_params.structured_outputs is None:
            continue
        m = sync_matcher(st, structured)
        if m is None:  # free until its ``after`` text (its drafts stop before completing it)
            continue
        spec = s.spec_token_ids
        consumed = 0
        for i in range(n):
            rows.append(first + i)
            masks.append(fill_bitmasks([m], vocab))
            if i < len(spec) and consumed == i and m.consume_token(spec[i]):
                consumed += 1  # past a draft the grammar refuses, the later rows' samples are discarded
        m.rollback(consumed)
    if not rows:
        return None
    allowed = unpack_bitmasks(torch.cat(masks), vocab).to(device)
    return torch.tensor(rows, device=device), allowed
