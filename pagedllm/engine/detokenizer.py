"""Incremental detokenization: text grows as tokens arrive, correct across multi-byte UTF-8 characters split over
several byte-level tokens and across tokens whose text depends on their neighbours.

Keeps a window [prefix_offset, read_offset) of already-emitted tokens as context: the new text is what decoding
the window plus the new tokens adds beyond decoding the window alone. Text ending in U+FFFD (an incomplete UTF-8
sequence) is held back until the next token completes it.
"""

from __future__ import annotations

INITIAL_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 special_ids: frozenset[int] | None = None) -> None:
        """``special_ids``: the tokenizer's special token ids, where the caller keeps them (transformers builds
        ``all_special_ids`` anew on every read)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        if special_ids is None:
            special_ids = frozenset(tokenizer.all_special_ids)
        self.special_ids = special_ids if skip_special_tokens else frozenset()
        context = [t for t in prompt_token_ids[-INITIAL_CONTEXT:] if t not in self.special_ids]
        self.tokens: list[str] = tokenizer.convert_ids_to_tokens(context)
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def add_token(self, token_id: int) -> str:
        """Append one token; returns the text it completes (maybe empty)."""
        if token_id in self.special_ids:
            return ""
        self.tokens.append(self.tokenizer.convert_ids_to_tokens(token_id))
        to_str = self.tokenizer.convert_tokens_to_string
        prefix = to_str(self.tokens[self.prefix_offset : self.read_offset])
        full = to_str(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            self.text += delta
            return delta
        return ""
