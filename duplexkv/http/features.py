"""What a server honours beyond plain generation, so that one request parser
(`duplexkv.http.openai`) serves a worker with its flags and the router (which honours none of
these yet: a request using them is a 400 there, naming the field).
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

__all__ = ["Features", "NONE"]
