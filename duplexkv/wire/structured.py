"""A request's output constraint (structured output, forced tool calls), declared once.

`StructuredOutput` is what the OpenAI layer makes of `response_format`, vLLM's
`structured_outputs` (and its older `guided_*` fields) and a forced `tool_choice`; the engine
compiles it into a grammar (engine/grammar.py) whose token mask the sampler applies. It stays
torch-free and library-free: the grammar library is the engine's business.

    kind         spec
    json         a JSON schema, as JSON text
    json_object  "" (any JSON object)
    regex        a regular expression the whole output matches
    choice       a JSON list of strings: the output is exactly one of them
    grammar      a Lark grammar (llguidance's dialect; vLLM's `grammar`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar larger than 1 MiB is refused


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    kind: Kind
    spec: str = ""
    # JSON kinds: free whitespace between tokens (vLLM's `disable_any_whitespace: false`); off by
    # default, so a model cannot pad its answer with blanks until max_tokens
    any_whitespace: bool = False
    source: str = "structured_outputs"  # the request field it came from (errors name it)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"invalid structured output kind {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"invalid structured output spec: a string of at most "
                             f"{MAX_SPEC_CHARS} characters")


__all__ = ["KINDS", "StructuredOutput"]
