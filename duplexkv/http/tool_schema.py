"""A forced `tool_choice` as the grammar the output must follow (vLLM's shapes):

    named      the function's `parameters` schema: the whole output is the call's arguments
    required   [{"name": <one of the tools>, "parameters": {...}}, ...], at least one call (one at
               most with `parallel_tool_calls: false`)

The worker reads such output back into `tool_calls` (server/chat_output.py).
"""

from __future__ import annotations

import json

from duplexkv.http.chat_options import ChatOptions
from duplexkv.wire.structured import StructuredOutput

ANY_OBJECT: dict = {"type": "object"}


def parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or ANY_OBJECT


def forced_tool_output(options: ChatOptions) -> StructuredOutput | None:
    choice, tools = options.tool_choice, options.tools or []
    if choice.mode == "named":
        tool = next(t for t in tools if t["function"]["name"] == choice.name)
        return StructuredOutput("json", json.dumps(parameters(tool), ensure_ascii=False),
                                source="tool_choice")
    if choice.mode != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not options.parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutput("json", json.dumps(schema, ensure_ascii=False), source="tool_choice")


__all__ = ["forced_tool_output", "parameters"]
