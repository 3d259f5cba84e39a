"""A conversation recognised from its content: a chat request that names no conversation
continues the one whose last turn (that turn's messages + the assistant message D produced) is
a prefix of its own messages. No standard client sends a conversation id; this gives them reuse.

    canonical  per message, the fields that make its prompt: [role, content, tool_calls,
               tool_call_id, name]. content: a string as is (None -> ""); a list of parts that
               are all text -> their texts joined by "\\n" (the string form vLLM renders); any
               other list -> text parts as their text, other parts (images, audio) as they are.
               tool_calls: each call as [id, type, name, arguments], arguments that are a JSON
               object by their parsed value (a client that re-serialises them, such as an
               Anthropic client sending a call back as a tool_use `input`, spaces them its own
               way: the match is only a hint, the tokens are verified). Ignored: reasoning and
               reasoning_content (chat templates drop an earlier turn's reasoning and clients
               strip it), refusal, annotations, audio, function_call, any other field.
    key        the prefix hash of messages[:i]: SHA-256 over a namespace (a domain tag, the
               router API key that authenticated, the model, the request's tools and chat
               template options), then each message's canonical form, self-delimiting
               (length-prefixed text; JSON only for the rare fields). One running
               hash read at the few positions looked up: a chain h_i = H(h_{i-1} || m_i) would
               finalise a digest per message that nobody asks for. The store key is its first
               40 hex digits (an explicit id's key, store.conversation_key, has another domain).
    lookup     the prefixes that end with an assistant message, newest first, at most
               MAX_LOOKUPS (the previous turn's is all messages but the new user message or
               tool results after it)
    store      when D's turn ends: the key of (the request's messages + D's answer)

Recognition is a hint, never trusted: the turn replays the entry found and P (or D, or the
router's token check for a vLLM P) verifies every token before it reads. /v1/completions is not
recognised: a raw prompt has no turn boundaries to hash at (send a conversation id).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from duplexkv.router.request import ClientRequest

MAX_LOOKUPS = 3
KEY_HEX = 40
_DOMAIN = b"duplexkv-recognise-v1\x00"
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True,
                         check_circular=False)
_NAMESPACE_FIELDS = ("tools", "chat_template", "chat_template_kwargs")


@dataclass(frozen=True, slots=True)
class Recognition:
    """A chat turn without a conversation id: the keys to look up, and the running hash after
    its messages (its answer's key extends it)."""

    candidates: tuple[str, ...]  # store keys of the prefixes to look up, newest first
    own_key: str  # the key of all the request's messages (the turn's key when nothing matched)
    after: Any = field(repr=False, compare=False)  # hashlib object after the request's messages

    def answer_key(self, answer: dict | None) -> str | None:
        """Where D's params go: the key of the request's messages + D's answer (None: the
        answer is not known, nothing is stored)."""
        if answer is None:
            return None
        h = self.after.copy()
        _feed(h, [answer])
        return h.hexdigest()[:KEY_HEX]


def recognition_of(req: ClientRequest) -> Recognition | None:
    """The recognition of a chat request that names no conversation (and did not opt out with
    `conversation_id: ""`), with one choice; None otherwise."""
    body = req.body
    messages = body.get("messages")
    if (req.kind != "chat" or req.conversation_id is not None or req.unlinked
            or req.conversation_key is not None
            or not isinstance(messages, list) or not messages or body.get("n") not in (None, 1)):
        return None
    ends = []
    for i in range(len(messages) - 1, -1, -1):
        if _role(messages[i]) == "assistant":
            ends.insert(0, i + 1)
            if len(ends) == MAX_LOOKUPS:
                break
    h = hashlib.sha256(_namespace(req))
    keys, start = [], 0
    for end in ends:
        _feed(h, messages[start:end])
        keys.append(h.hexdigest()[:KEY_HEX])
        start = end
    _feed(h, messages[start:])
    return Recognition(tuple(reversed(keys)), h.hexdigest()[:KEY_HEX], h)


def canonical(message: Any) -> tuple[str, str]:
    """What of a message makes its prompt (module docstring), self-delimiting, as (head, body):
    a message with only a role and text is `m<len>:<role><len>:` + the text (not escaped: it
    is the bulk of the history), any other `g<len>:` + the JSON of its fields."""
    if type(message) is dict:
        role, content = message.get("role"), message.get("content")
        if content is None:
            content = ""
        elif type(content) is list:
            content = _content(content)
        tool_calls, call_id, name = (message.get("tool_calls"), message.get("tool_call_id"),
                                     message.get("name"))
        if type(role) is str and type(content) is str and not tool_calls \
                and call_id is None and name is None:
            return f"m{len(role)}:{role}{len(content)}:", content
        fields = [role, content, _tool_calls(tool_calls), call_id, name]
    else:
        fields = ["", message]
    j = _JSON.encode(fields)
    return f"g{len(j)}:", j


def _role(message: Any) -> Any:
    return message.get("role") if type(message) is dict else None


def _content(content: list) -> Any:
    parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else p
             for p in content]
    if all(isinstance(p, str) for p in parts):
        return "\n".join(parts)
    return parts


def _tool_calls(calls: Any) -> Any:
    if not calls:
        return None
    if not isinstance(calls, list):
        return calls
    out = []
    for c in calls:
        if not isinstance(c, dict):
            out.append(c)
            continue
        fn = c.get("function") if isinstance(c.get("function"), dict) else {}
        out.append([c.get("id"), c.get("type") or "function", fn.get("name"),
                    _arguments(fn.get("arguments"))])
    return out


def _arguments(text: Any) -> Any:
    """A call's arguments: the object they encode (any spacing), else as they are."""
    if type(text) is not str or not text.lstrip().startswith("{"):
        return text
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if type(value) is dict else text


def _feed(h: Any, messages: list) -> None:
    """Each message's canonical form into the running hash. ASCII text is joined into one
    update; other text goes alone (joined, one non-ASCII character would widen the whole
    history's string and slow its encoding)."""
    update, run = h.update, []
    for m in messages:
        if type(m) is dict and len(m) == 2 and type(body := m.get("content")) is str \
                and type(role := m.get("role")) is str:  # canonical()'s plain case, inline
            head = f"m{len(role)}:{role}{len(body)}:"
        else:
            head, body = canonical(m)
        run.append(head)
        if body.isascii():
            run.append(body)
        else:
            update("".join(run).encode("utf-8", "surrogatepass"))
            update(body.encode("utf-8", "surrogatepass"))
            run = []
    update("".join(run).encode("utf-8", "surrogatepass"))


def _namespace(req: ClientRequest) -> bytes:
    scope = [req.api_key or "", req.model or "",
             *(req.body.get(k) for k in _NAMESPACE_FIELDS)]
    return _DOMAIN + _JSON.encode(scope).encode("utf-8", "surrogatepass")
