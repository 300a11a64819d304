"""Reasoning parsers (``--reasoning-parser``, vLLM's names): splitting a reasoning model's output into its
reasoning (``<think>...</think>``) and its answer, whole (``split``) or as it streams (``feed`` / ``finish``).

- ``deepseek_r1``: the chat template has already opened ``<think>``, so the output starts inside the reasoning (an
  opening tag the model writes anyway is dropped): everything up to ``</think>`` is reasoning, the rest is content;
  an output without ``</think>`` is all reasoning.
- ``qwen3``: thinking is optional. Whole: without ``</think>`` everything is content; with it, the part before
  (less an opening ``<think>``) is reasoning. Streamed: an output that starts with ``<think>`` streams as reasoning
  until ``</think>``; one that does not streams as content (a stray ``</think>`` in it is dropped), since what it
  is cannot be known until the output ends.

- ``openai_gptoss``: gpt-oss's harmony format (its tags are special tokens, kept in the output's text for it): the
  output is messages ``<|channel|>NAME[ to=...]<|message|>TEXT``, each ended by ``<|end|>`` (then ``<|start|>assistant``
  and the next), ``<|return|>`` or ``<|call|>``; the ``analysis`` channel is reasoning, ``final`` (and a
  ``commentary`` preamble) content. A message addressed to a tool (``to=functions.NAME``) goes to the content as
  ``<|channel|>commentary to=functions.NAME<|message|>ARGS``, which ``--tool-call-parser openai`` reads (without it,
  that text is the content; a built-in tool's, ``to=browser...``, stays content). Text before any header is content;
  an unfinished header at the end (an output cut short) is dropped.

The tags themselves are in neither part; a tag split across two deltas is held back until it is whole (or proves
not to be a tag). ``make_reasoning_parser`` gives the parser of a name."""

from __future__ import annotations

import re

REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")
THINK_START = "<think>"
THINK_END = "</think>"


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` are a proper prefix of ``tag`` (held back: they may become it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """One output's parser: ``split`` a whole text, or ``feed`` its deltas and ``finish``; ``advance`` takes the
    output's text so far (as the engine reports it) instead of deltas. ``answer_marker``: the text after which the
    answer starts (where a structured-output constraint begins); ``keeps_special_tokens``: the output's text must
    keep its special tokens (the tags are such tokens)."""

    answer_marker = THINK_END
    keeps_special_tokens = False

    def __init__(self, name: str, closed: bool = False) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose from {REASONING_PARSERS}")
        if name == "openai_gptoss" and type(self) is ReasoningParser:
            raise ValueError("openai_gptoss is HarmonyParser's: make_reasoning_parser gives the parser of a name")
        self.name = name
        self.starts_inside = name == "deepseek_r1"  # the template opened <think>
        self._buf = ""  # text not routed yet: a possible tag prefix
        self._started = False  # past the output's start (where an opening <think> may be)
        self._reasoning = False  # inside the reasoning now
        self._ended = closed  # </think> seen (or the prompt closed the reasoning): everything after is content
        self._finished = False
        self._seen = 0  # advance(): how much of the text was fed
        self._content = ""  # advance(): the content so far

    def fresh(self, closed: bool = False) -> ReasoningParser:
        """A parser for one output; ``closed``: the prompt has closed the reasoning, the output is all content."""
        return ReasoningParser(self.name, closed)

    # ------------------------------------------------------------------ whole text
    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; an empty part is None."""
        if self._ended:
            return None, text or None
        head, tag, tail = text.partition(THINK_END)
        if not tag:
            if self.starts_inside:
                return text.removeprefix(THINK_START) or None, None
            return None, text or None
        if THINK_START in head:
            head = head.partition(THINK_START)[2]
        return head or None, tail or None

    # ------------------------------------------------------------------ incremental
    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) of the next piece of output."""
        self._buf += delta
        if self._ended:
            out, self._buf = self._buf, ""
            return "", out
        if not self._started:
            if THINK_START.startswith(self._buf) and len(self._buf) < len(THINK_START):
                return "", ""  # may still become the opening tag
            self._started = True
            opened = self._buf.startswith(THINK_START)
            if opened:
                self._buf = self._buf[len(THINK_START):]
            self._reasoning = opened or self.starts_inside
        reasoning = content = ""
        head, tag, tail = self._buf.partition(THINK_END)
        if tag:
            self._ended = True
            self._buf = ""
            if self._reasoning:
                reasoning = head
            else:
                content = head
            return reasoning, content + tail
        keep = _held(self._buf, THINK_END)
        out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return (out, "") if self._reasoning else ("", out)

    def finish(self) -> tuple[str, str]:
        """The held-back rest once the output has ended (a partial tag there was text)."""
        if self._finished:
            return "", ""
        self._finished = True
        if not self._started:
            self._started = True
            self._reasoning = self.starts_inside
        out, self._buf = self._buf, ""
        return (out, "") if self._reasoning and not self._ended else ("", out)

    def advance(self, text: str, finished: bool) -> tuple[str, str]:
        """Given the output's whole text so far: (the reasoning not returned before, all the content so far)."""
        reasoning, content = self.feed(text[self._seen:])
        self._seen = len(text)
        if finished:
            r, c = self.finish()
            reasoning, content = reasoning + r, content + c
        self._content += content
        return reasoning, self._content


HARMONY_MESSAGE = "<|message|>"
HARMONY_CHANNEL = "<|channel|>"
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>")  # what ends a message's text


class HarmonyParser(ReasoningParser):
    """gpt-oss's harmony messages (``openai_gptoss``, see the module's note), behind ``ReasoningParser``'s
    interface."""

    answer_marker = HARMONY_CHANNEL + "final" + HARMONY_MESSAGE
    keeps_special_tokens = True

    def __init__(self, name: str = "openai_gptoss", closed: bool = False) -> None:
        super().__init__("qwen3")  # the state advance() keeps; the routing below is harmony's own
        self.name = name
        # inside a message: "reasoning" or "content" (a tool call's too); a prompt that ends with the final channel's
        # header (``closed``) starts the output inside that message
        self._route: str | None = "content" if closed else None

    def fresh(self, closed: bool = False) -> "HarmonyParser":
        return HarmonyParser(self.name, closed)

    @staticmethod
    def _route_of(header: str) -> tuple[str, str]:
        """(where a message's text goes, text that opens it there) from its header
        (``<|start|>assistant<|channel|>final``, ...): a tool call's opens with its canonical header."""
        if (to := re.search(r"(?:^|\s)to=([^\s<]+)", header)) is not None:
            return "content", f"{HARMONY_CHANNEL}commentary to={to.group(1)}{HARMONY_MESSAGE}"
        channel = header.rpartition(HARMONY_CHANNEL)[2] if HARMONY_CHANNEL in header else ""
        return ("reasoning" if channel.split(" ", 1)[0].split("<|", 1)[0] == "analysis" else "content"), ""

    def split(self, text: str) -> tuple[str | None, str | None]:
        parser = self.fresh()
        reasoning, content = parser.feed(text)
        r, c = parser.finish()
        return (reasoning + r) or None, (content + c) or None

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        out = {"reasoning": "", "content": ""}
        while self._buf:
            if self._route is None:  # between messages: a header up to <|message|>, or plain text (content)
                if not (self._buf.startswith("<|") or "<|".startswith(self._buf)):
                    self._route = "content"  # not a tag: text outside any message
                    continue
                head, tag, tail = self._buf.partition(HARMONY_MESSAGE)
                if not tag:
                    break  # the header is not whole yet
                self._route, opening = self._route_of(head)
                out[self._route] += opening
                self._buf = tail
                continue
            ends = [(i, t) for t in HARMONY_ENDS if (i := self._buf.find(t)) >= 0]
            if ends:
                i, t = min(ends)
                out[self._route] += self._buf[:i]
                # <|start|> opens the next message's header: kept for it
                self._buf, self._route = self._buf[i if t == "<|start|>" else i + len(t):], None
                continue
            keep = max(_held(self._buf, t) for t in HARMONY_ENDS)
            out[self._route] += self._buf[:len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return out["reasoning"], out["content"]

    def finish(self) -> tuple[str, str]:
        if self._finished:
            return "", ""
        self._finished = True
        rest, self._buf = self._buf, ""
        if self._route == "reasoning":
            return rest, ""
        if self._route is None and rest.startswith("<|"):
            return "", ""  # an unfinished header
        return "", rest


def make_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name`` (one of ``REASONING_PARSERS``)."""
    return HarmonyParser(name) if name == "openai_gptoss" else ReasoningParser(name)
