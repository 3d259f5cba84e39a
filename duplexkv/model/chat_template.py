"""`--chat-template`: a file holding a jinja chat template, or the template itself (as vLLM).

A value with none of `{`, `}` or a newline is a path, and a path that cannot be read is an error
(a typo would otherwise become a template that renders its own file name); anything else is the
template, with backslash escapes (`\\n`) decoded as vLLM does.
"""

from __future__ import annotations

import codecs
from pathlib import Path

from duplexkv.model.config import ModelLoadError

_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if not any(c in value for c in _JINJA_CHARS):
        path = Path(value).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"--chat-template {value!r} looks like a file path but cannot "
                                 f"be read ({e.__class__.__name__}: {e}); give a readable "
                                 "file or the template text itself") from None
        if not text.strip():
            raise ModelLoadError(f"--chat-template file {path} is empty")
        return text
    return codecs.decode(value, "unicode_escape")
