"""The client key `duplexkv up` requires when none is given: made once, kept in a file only its
owner can read (`<cache dir>/api-key`, mode 0600, in a directory of mode 0700), reused by every
later `up`, so that on a shared host no other local user can use the router (issue 32), while
its owner reads the key with `export DUPLEXKV_API_KEY=$(cat <file>)`, as a Jupyter user reads
its token. The key is never printed or logged; only the file's path is."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from duplexkv.http.auth import check_key
from duplexkv.paths import cache_dir


class KeyFileError(Exception):
    """The key file cannot be used; the message names the fix."""


def key_file() -> Path:
    return cache_dir() / "api-key"


def own_client_key(path: Path | None = None) -> str:
    """The key in `path` (made, with a new random key, when missing)."""
    path = path or key_file()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _read(path)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return _read(path)


def _read(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise KeyFileError(f"cannot read the API key file {path} ({e.strerror}): remove it "
                           f"and `up` makes a new one, or pass --api-key") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid():
            raise KeyFileError(f"{path} belongs to another user: remove it, or pass --api-key")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(f"{path} is readable by other users: `chmod 600 {path}` "
                               f"(and use a new key if others may have read it: remove the "
                               f"file and `up` makes a new one)")
        key = f.read().strip()
    try:
        return check_key(key, str(path))
    except ValueError:
        raise KeyFileError(f"{path} holds no usable key: remove it and `up` makes a new one, "
                           f"or pass --api-key") from None
