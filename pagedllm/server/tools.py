"""OpenAI tool calling: which constraint a request's ``tools`` / ``tool_choice`` imply, and reading tool calls back
out of the generated text.

- ``tool_choice`` a named function: the output is constrained to that function's ``parameters`` JSON schema and is
  the call's arguments;
- ``required``: the output is constrained to a JSON array of ``{"name": ..., "arguments": ...}`` objects, each
  following its function's schema (one item at most when ``parallel_tool_calls`` is false);
- ``auto``: the model writes freely; a parser turns its calls into ``tool_calls``: ``--tool-call-parser hermes``
  (``<tool_call>{json}</tool_call>`` blocks, the format of Qwen2.5 and of Hermes-style templates) or ``openai``
  (gpt-oss's harmony tool messages, as ``--reasoning-parser openai_gptoss`` leaves them in the content:
  ``<|channel|>commentary to=functions.NAME<|message|>ARGS``);
- ``none`` (the default without tools): plain text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pagedllm.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "openai")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_HARMONY = re.compile(r"<\|channel\|>commentary to=functions\.([^\s<]+)<\|message\|>(.*?)(?=<\|channel\|>|$)", re.DOTALL)
CALL_START = {"hermes": "<tool_call>", "openai": "<|channel|>"}  # where a parser's tool calls begin


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    structured: StructuredOutputsParams | None  # the constraint for "required" / "named"
    funcs: dict[str, dict]  # name -> parameters schema of each tool
    named: str | None = None
    parser: str = "hermes"  # --tool-call-parser (what ``auto`` reads)


def check_tools(tools: list[dict] | None) -> dict[str, dict]:
    """name -> parameters schema of each function tool; ValueError for anything malformed."""
    funcs: dict[str, dict] = {}
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ValueError(f"tools[{i}]: only {{'type': 'function', 'function': {{...}}}} tools are supported")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
        if name in funcs:
            raise ValueError(f"tools[{i}]: duplicate function name {name!r}")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        funcs[name] = params
    return funcs


def plan_tools(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool, auto_enabled: bool,
               parser: str = "hermes") -> ToolPlan:
    funcs = check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if funcs else "none"
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if name is None:
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}")
        if name not in funcs:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return ToolPlan("named", StructuredOutputsParams(json=funcs[name]), funcs, name)
    if tool_choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}")
    if tool_choice != "none" and not funcs:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools")
    if tool_choice == "required":
        items = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                            "required": ["name", "arguments"], "additionalProperties": False}
                           for n, p in funcs.items()]}
        schema = {"type": "array", "items": items, "minItems": 1}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan("required", StructuredOutputsParams(json=schema), funcs)
    if tool_choice == "auto" and not auto_enabled:
        raise ValueError('"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                         "--tool-call-parser")
    return ToolPlan(tool_choice, None, funcs, parser=parser)


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def extract_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished output. Constrained modes parse their JSON; ``auto`` reads its parser's
    calls naming a known function (anything else stays content)."""
    if plan.mode == "named":
        return None, [_call(plan.named, text.strip())]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:  # cut short (max_tokens): no complete calls
            return text, []
        return None, [_call(it["name"], it["arguments"]) for it in items]
    if plan.mode != "auto":
        return text, []
    calls = []
    if plan.parser == "openai":
        for m in _HARMONY.finditer(text):
            if m.group(1) in plan.funcs:
                calls.append(_call(m.group(1), m.group(2).strip()))
    else:
        for m in _HERMES.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("name") in plan.funcs:
                calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
    if not calls:
        return text, []
    content = text[: text.find(CALL_START[plan.parser])].strip()
    return content or None, calls


def visible_content(plan: ToolPlan, text: str) -> str:
    """The part of ``text`` that streams as content: nothing in constrained modes; in ``auto``, the text before its
    parser's first tool call (``<tool_call>``, ``<|channel|>``), or before a trailing partial tag that may become
    one."""
    if plan.mode in ("named", "required"):
        return ""
    if plan.mode != "auto":
        return text
    start = CALL_START[plan.parser]
    at = text.find(start)
    if at >= 0:
        return text[:at]
    for k in range(len(start) - 1, 0, -1):  # hold back a prefix of the tag at the end
        if text.endswith(start[:k]):
            return text[:-k]
    return text


def stream_view(plan: ToolPlan, text: str, finished: bool) -> tuple[str, list[dict]]:
    """What a stream may show of an output so far (the text the client may see now) and, once it has finished, its
    tool calls: content streams as it comes, except what may be (or is) a tool call."""
    if plan.mode == "none":
        return text, []
    if not finished:
        return visible_content(plan, text), []
    _, calls = extract_tool_calls(plan, text)
    return (visible_content(plan, text) if calls else text), calls


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: assistant ``tool_calls`` with their arguments as objects."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                f = dict(c.get("function") or {})
                if isinstance(f.get("arguments"), str):
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except ValueError:
                        raise ValueError(f"tool call {c.get('id')!r}: arguments are not valid JSON") from None
                calls.append({**c, "function": f})
            m["tool_calls"] = calls
        out.append(m)
    return out
