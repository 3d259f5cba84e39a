"""What a server honours beyond plain generation, so that one request parser
(`duplexkv.http.openai`) serves a worker with its flags and the router. The router honours them
all by passing them on (`ROUTER`): it checks their shapes alone (nothing here needs a tokenizer)
and forwards them unchanged to both legs, where the workers compile the grammar and parse the tool
calls; tool_choice "auto" on workers started without --enable-auto-tool-choice is their 400,
relayed as it is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Features:
    # response_format, structured_outputs and a forced tool_choice ("required", a named
    # function): guided decoding by a grammar (engine/grammar.py)
    structured: bool = False
    # tool_choice "auto" (vLLM's --enable-auto-tool-choice --tool-call-parser)
    auto_tools: bool = False


NONE = Features()
ROUTER = Features(structured=True, auto_tools=True)

__all__ = ["Features", "NONE", "ROUTER"]
