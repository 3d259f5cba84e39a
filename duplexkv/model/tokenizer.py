"""The model's tokenizer (`tokenizer.json` via the `tokenizers` library) and its chat template.

Chat templates render exactly as in HF transformers: a sandboxed jinja2 environment with
trim_blocks, lstrip_blocks, `raise_exception`, a non-escaping `tojson`, special tokens as variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from duplexkv.model.config import ModelLoadError
from duplexkv.model.loader import read_json
from duplexkv.model.segment_cache import SegmentCache

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


def _token_str(value: Any) -> str | None:
    # tokenizer_config stores special tokens as "text" or as {"content": "text", ...}
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def compile_chat_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
        eos_token_ids: tuple[int, ...],
        source: Path,
    ) -> None:
        self._tok = tokenizer
        self.special_tokens = special_tokens  # bos_token/eos_token/... -> text, for templates
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.source = source
        self.segments = SegmentCache(tokenizer)  # earlier messages' ids, reused across turns

    @classmethod
    def from_dir(cls, model_dir: str | Path, chat_template: str | None = None) -> Tokenizer:
        """`chat_template` (the template's text) replaces the directory's own."""
        root = Path(model_dir)
        path = root / TOKENIZER_FILE
        if not path.is_file():
            raise ModelLoadError(
                f"{path}: file not found (a model directory needs {TOKENIZER_FILE})"
            )
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception
            raise ModelLoadError(
                f"{path}: cannot be loaded by the tokenizers library ({e})"
            ) from None
        tcfg_path = root / TOKENIZER_CONFIG_FILE
        tcfg = read_json(tcfg_path) if tcfg_path.is_file() else {}
        special = {k: s for k in _SPECIAL_KEYS if (s := _token_str(tcfg.get(k))) is not None}
        template = tcfg.get("chat_template")
        if (root / CHAT_TEMPLATE_FILE).is_file():
            template = (root / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        elif isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if chat_template is not None:
            template = chat_template
        # eos: generation_config first (what generate() stops on), then tokenizer/model config
        eos: list[int] = []
        gen_path = root / GENERATION_CONFIG_FILE
        if gen_path.is_file():
            eos += _ids(read_json(gen_path).get("eos_token_id"))
        if (eos_text := special.get("eos_token")) is not None:
            eos += _ids(tok.token_to_id(eos_text))
        if not eos and (root / "config.json").is_file():
            eos += _ids(read_json(root / "config.json").get("eos_token_id"))
        return cls(tok, special, template if isinstance(template, str) else None,
                   tuple(dict.fromkeys(eos)), root)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def backend_json(self) -> str:
        """The `tokenizers` JSON (what a grammar library builds its token trie from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False,
               limit: int | None = None) -> list[int]:
        """Token ids; `segment_cache.TooManyTokens` as soon as more than `limit` are certain."""
        if add_special_tokens:
            return self._tok.encode(text, add_special_tokens=True).ids
        return self.segments.encode(text, limit)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ModelLoadError(
                f"{self.source / TOKENIZER_CONFIG_FILE}: no 'chat_template' "
                f"(nor {CHAT_TEMPLATE_FILE}); use a completion endpoint or add a template"
            )
        return compile_chat_template(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        # like transformers: keys whose value is None are dropped; kwargs override special tokens
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return self._template.render(
            messages=msgs,
            tools=kwargs.pop("tools", None),
            documents=kwargs.pop("documents", None),
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs},
        )


class IncrementalDetokenizer:
    """Streams text as tokens arrive, holding back an incomplete UTF-8 sequence (a trailing U+FFFD).

    Decodes only a window: the tokens since the last emitted text plus the ones before them
    (`prefix`), so byte-level pieces that join across tokens come out right at O(window) per push.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens up to here are emitted
        self._emitted: list[str] = []

    def _window_text(self, end: int) -> str:
        return self._tok.decode(self.ids[self._prefix:end], skip_special_tokens=self._skip)

    def push(self, token_ids: list[int] | int) -> str:
        self.ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        before = self._window_text(self._read)
        now = self._window_text(len(self.ids))
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        delta = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever push() held back (an incomplete sequence as U+FFFD)."""
        rest = self.text[len(self.emitted):]
        if rest:
            self._emitted.append(rest)
            self._prefix = self._read = len(self.ids)
        return rest

    @property
    def emitted(self) -> str:
        return "".join(self._emitted)

    @property
    def text(self) -> str:
        return self._tok.decode(self.ids, skip_special_tokens=self._skip)
