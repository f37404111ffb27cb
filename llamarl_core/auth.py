"""The run's secret, and the authentication every control-plane value carries.

Anyone who can reach a run's Store (a TCPStore listens on every interface of its
host) can read and write its keys. What the run trusts is the secret, never the
Store: every controller <-> executor message and every weight-sync value written
to the Store is tagged with HMAC-SHA256 under the run's secret, and a value whose
tag does not verify is dropped before anything reads it.

The secret travels outside the Store:
- `llamarl train` makes a new one per run (`new_secret`) and hands it to the
  executors it forks in their arguments (the fork's memory, never the network);
- under torchrun every rank reads it from the environment: `LLAMARL_SECRET` (hex,
  at least 32 digits) or `LLAMARL_SECRET_FILE` (a file holding that hex, readable
  by its owner only, mode 0600), the same on every host (`secret_from_env`);
- a framework that embeds the weight sync passes `secret=` to its endpoints, or
  sets the environment as above.

A tag binds a value to its `context` (its full Store key, and for a queue the
message's number): a value copied to another key or slot does not verify.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

SECRET_ENV = "LLAMARL_SECRET"
SECRET_FILE_ENV = "LLAMARL_SECRET_FILE"
SECRET_BYTES = 32  # what new_secret makes
MIN_SECRET_BYTES = 16  # the shortest secret accepted from the environment
TAG_BYTES = 32  # HMAC-SHA256


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def parse_secret(text: str, where: str) -> bytes:
    """The secret written as hex in `where` (an environment variable or a file);
    ValueError naming `where` when it is not hex or is shorter than MIN_SECRET_BYTES."""
    text = text.strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{where}: the secret must be hex digits (make one with: python -c "
                         f"'import secrets; print(secrets.token_hex(32))')") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{where}: the secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} "
                         f"({2 * MIN_SECRET_BYTES} hex digits) are needed")
    return secret


def read_secret_file(path: str | Path) -> bytes:
    """The secret in `path`; PermissionError when the file is readable by anyone but
    its owner or owned by another user (a secret others can read authenticates nobody)."""
    path = Path(path)
    info = path.stat()
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(f"{path}: the secret file has mode {stat.S_IMODE(info.st_mode):04o}; "
                              f"it must be readable by its owner only (chmod 600 {path})")
    if info.st_uid != os.getuid():
        raise PermissionError(f"{path}: the secret file belongs to uid {info.st_uid}, not to this process's "
                              f"user ({os.getuid()})")
    return parse_secret(path.read_text(), str(path))


def write_secret_file(path: str | Path, secret: bytes) -> None:
    """Write `secret` as hex to a new file `path`, mode 0600 from its creation (never
    readable by others, not even for a moment). FileExistsError if `path` exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")


def secret_from_env(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The secret set for this process: LLAMARL_SECRET, else the file named by
    LLAMARL_SECRET_FILE, else None. Both set is refused (which one is meant?)."""
    text, path = environ.get(SECRET_ENV), environ.get(SECRET_FILE_ENV)
    if text and path:
        raise ValueError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set: set one")
    if text:
        return parse_secret(text, SECRET_ENV)
    if path:
        return read_secret_file(path)
    return None


def derive(secret: bytes, label: str) -> bytes:
    """A secret of its own for `label` (a run's Store namespace): two runs of one job
    share the job's secret, but a value of one never verifies in the other."""
    return hmac.new(secret, b"llamarl/derive\0" + label.encode(), hashlib.sha256).digest()


def sign(secret: bytes, context: str, body: bytes) -> bytes:
    """`body` with its tag in front: HMAC-SHA256(secret, context NUL body) + body."""
    return _tag(secret, context, body) + body


def verify(secret: bytes, context: str, data: bytes) -> bytes | None:
    """The body of `data` if its tag is `context`'s under `secret`, else None."""
    if len(data) < TAG_BYTES:
        return None
    body = data[TAG_BYTES:]
    return body if hmac.compare_digest(data[:TAG_BYTES], _tag(secret, context, body)) else None


def _tag(secret: bytes, context: str, body: bytes) -> bytes:
    mac = hmac.new(secret, context.encode(), hashlib.sha256)
    mac.update(b"\0")
    mac.update(body)
    return mac.digest()
