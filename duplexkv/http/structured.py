"""`response_format` and vLLM's `structured_outputs` -> a typed `StructuredOutput` (or None).

    response_format     {"type": "text"}                       no constraint
                        {"type": "json_object"}                any JSON object
                        {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs  exactly one of json (schema object or its text), regex, choice (list of
                        strings), grammar (Lark), json_object (true); `disable_any_whitespace`

Both at once is a 400 (vLLM lets `structured_outputs` win silently; a client sending both has a
bug). Whether the schema or grammar compiles is checked by the engine (a 400 naming the field).
"""

from __future__ import annotations

import json
from typing import Any

from duplexkv.http.errors import bad_request
from duplexkv.wire.structured import MAX_SPEC_CHARS, StructuredOutput

_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CHOICES = 1024


def parse_structured(body: dict) -> StructuredOutput | None:
    rf = _response_format(body.get("response_format"))
    so = _structured_outputs(body.get("structured_outputs"))
    if rf is not None and so is not None:
        raise bad_request("send either `response_format` or `structured_outputs`, not both",
                          "structured_outputs")
    return rf or so


def _response_format(v: Any) -> StructuredOutput | None:
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", source="response_format")
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request("`response_format.json_schema.schema` must be a JSON schema object",
                              "response_format")
        return StructuredOutput("json", _text(spec["schema"], "response_format"),
                                source="response_format")
    raise bad_request("`response_format.type` must be \"text\", \"json_object\" or "
                      f"\"json_schema\", got {kind!r:.40}", "response_format")


def _structured_outputs(v: Any) -> StructuredOutput | None:
    if v is None:
        return None
    name = "structured_outputs"
    if not isinstance(v, dict):
        raise bad_request(f"`{name}` must be an object", name)
    given = [k for k in _SO_KINDS if v.get(k) is not None]
    if "structural_tag" in v and v["structural_tag"] is not None:
        raise bad_request(f"`{name}.structural_tag` is not supported by this server", name)
    if len(given) != 1:
        raise bad_request(f"`{name}` must set exactly one of {', '.join(_SO_KINDS)}, got "
                          f"{len(given)}", name)
    ws = v.get("disable_any_whitespace", True)
    if not isinstance(ws, bool):
        raise bad_request(f"`{name}.disable_any_whitespace` must be a boolean", name)
    kind, value, where = given[0], v[given[0]], f"{name}.{given[0]}"
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"`{where}` is not valid JSON", where) from None
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"`{where}` must be a JSON schema", where)
        return StructuredOutput("json", _text(value, where), any_whitespace=not ws)
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"`{where}` must be true", where)
        return StructuredOutput("json_object", any_whitespace=not ws)
    if kind == "choice":
        if not isinstance(value, list) or not value or len(value) > MAX_CHOICES \
                or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"`{where}` must be a list of 1-{MAX_CHOICES} non-empty strings",
                              where)
        return StructuredOutput("choice", _text(value, where))
    if not isinstance(value, str) or not value or len(value) > MAX_SPEC_CHARS:
        raise bad_request(f"`{where}` must be a non-empty string of at most {MAX_SPEC_CHARS} "
                          "characters", where)
    return StructuredOutput(kind, value)  # type: ignore[arg-type]


def _text(value: Any, where: str) -> str:
    text = json.dumps(value, ensure_ascii=False)
    if len(text) > MAX_SPEC_CHARS:
        raise bad_request(f"`{where}` is larger than {MAX_SPEC_CHARS} characters", where)
    return text


__all__ = ["parse_structured"]
