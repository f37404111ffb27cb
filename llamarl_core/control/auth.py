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

A tag binds a value to its `context` (its full Store key; a queue's message to its
queue, over its producer's id and count: queues.py): a value copied to another
key or queue does not verify.

What is refused is counted in this process (`refused_count`, the pipeline's
`forged_messages` metric) and logged naming its key: the first LOG_FIRST one by
one, then one in LOG_EVERY. A refused value never reaches the code that reads
the Store. What the tags cannot stop is denial of service: anyone who reaches the
Store can delete a key, overwrite a genuine value (its reader then waits for a
genuine one until its timeout) or bump a counter.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist

SECRET_ENV = "LLAMARL_SECRET"
SECRET_FILE_ENV = "LLAMARL_SECRET_FILE"
SECRET_BYTES = 32  # what new_secret makes
MIN_SECRET_BYTES = 16  # the shortest secret accepted from the environment
TAG_BYTES = 32  # HMAC-SHA256
# The first refused values are logged one by one, then one in LOG_EVERY (all are counted).
LOG_FIRST, LOG_EVERY = 10, 1000
# A read that finds a value that does not verify looks again, this long apart at most
# (1 ms, doubling), until a genuine value replaces it or its timeout passes.
REREAD_S = 0.125

log = logging.getLogger(__name__)
_refused = [0]
_refused_lock = threading.Lock()


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


def required_secret(secret: bytes | None, who: str) -> bytes:
    """`secret` checked, or when None the one set in the environment
    (secret_from_env); ValueError naming `who` when there is none, or it is not
    bytes of at least MIN_SECRET_BYTES."""
    if secret is None:
        secret = secret_from_env()
    if secret is None:
        raise ValueError(f"{who}: no secret: pass secret= (the same bytes on every rank, e.g. auth.new_secret() made "
                         f"once and handed to each process; in a generator plug-in of the pipeline, context.secret) "
                         f"or set {SECRET_ENV} / {SECRET_FILE_ENV}; make one with "
                         "python -c 'import secrets; print(secrets.token_hex(32))'")
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{who}: the secret must be bytes, at least {MIN_SECRET_BYTES} of them, got "
                         f"{type(secret).__name__} of length {len(secret) if hasattr(secret, '__len__') else '?'}")
    return secret


def refused_count() -> int:
    """How many values this process has refused (forged or malformed messages,
    Store values whose tag does not verify), since it started."""
    return _refused[0]


def refuse(what: str, key: str, why: str) -> None:
    """Count one refused value and log it (`what` at key `key`, and `why`)."""
    with _refused_lock:
        _refused[0] += 1
        count = _refused[0]
    if count <= LOG_FIRST or count % LOG_EVERY == 0:
        log.warning("%s at key %s (%s); %d refused so far in this process", what, key, why, count)


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


class AuthenticatedStore(dist.Store):
    """`store` as its holders of `secret` see it: every value `set` carries a tag
    bound to `label` + its key, and a value whose tag does not verify reads as
    not set: `get`, `multi_get` and `wait` go on waiting for a genuine one (within
    the store's timeout, or the wait's), `check` says False; `read` tells a key
    not set from one holding a value that does not verify, without waiting. Each
    distinct value refused is counted and logged once (`refuse`). A
    torch.distributed Store, so a process group's rendezvous can run through it (a
    forged peer address is then never read). Counters (`add`) are plain integers,
    not authenticated: what reads them takes a count as a hint to look at
    authenticated keys, never as an address. `append` and the queue operations
    are not offered (a tag covers a whole value). `inner` is the Store underneath."""

    _SEEN = 256  # forged values remembered per store (a waiting reader meets one many times)

    def __init__(self, store: dist.Store, secret: bytes, label: str = ""):
        super().__init__()
        self.inner, self._secret, self._label = store, required_secret(secret, "AuthenticatedStore"), label
        self._seen: OrderedDict = OrderedDict()
        # What compare_set answers for a key that is not set (`read`): unguessable, so that no value
        # a stranger writes can pass for "not set".
        self._absent = b"llamarl:not-set:" + secrets.token_bytes(16)
        dist.Store.set_timeout(self, store.timeout)  # what C++ callers (a PrefixStore over this one) see

    def _context(self, key: str) -> str:
        return self._label + key

    def _open(self, key: str, data: bytes) -> bytes | None:
        """The value's body, or None (refused: counted once per distinct value)."""
        body = verify(self._secret, self._context(key), data)
        if body is None:
            seen = (key, hashlib.sha256(data).digest())
            if seen not in self._seen:
                self._seen[seen] = None
                if len(self._seen) > self._SEEN:
                    self._seen.popitem(last=False)
                refuse("ignored a value that is not the run's", self._context(key),
                       "its tag does not verify under the secret")
        return body

    def _tagged(self, key: str, value) -> bytes:
        return sign(self._secret, self._context(key), value.encode() if isinstance(value, str) else bytes(value))

    def read(self, key: str) -> tuple[bool, bytes | None]:
        """Without waiting (one request, compare_set with a value nobody writes):
        (False, None) when `key` is not set, (True, None) when it holds a value that
        does not verify, (True, body) when it holds a genuine one."""
        raw = self.inner.compare_set(key, self._absent, self._absent)
        return (False, None) if raw == self._absent else (True, self._open(key, raw))

    def set(self, key: str, value) -> None:
        self.inner.set(key, self._tagged(key, value))

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The genuine values of `keys`, waiting for every one to be set (within the
        store's timeout, DistStoreError past it, naming the keys that hold values that
        do not verify)."""
        values = [self._open(k, v) for k, v in zip(keys, self.inner.multi_get(keys))]
        if all(v is not None for v in values):
            return values
        return self._reread(keys, time.monotonic() + self.inner.timeout.total_seconds())

    def wait_get(self, keys: list[str], timeout: datetime.timedelta | None = None) -> list[bytes]:
        """Wait until every key holds a genuine value and return them (one read of
        each once all are set); DistStoreError after `timeout` (default: the store's)."""
        timeout = self.inner.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout.total_seconds()
        self.inner.wait(keys, timeout)
        return self._reread(keys, deadline)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self.wait_get(keys, timeout)

    def _reread(self, keys: list[str], deadline: float) -> list[bytes]:
        """Read `keys` without waiting until every one is genuine (1 ms apart,
        doubling to REREAD_S), or raise DistStoreError at `deadline`."""
        pause = 1e-3
        while True:
            found = [self.read(k) for k in keys]
            if all(body is not None for _, body in found):
                return [body for _, body in found]
            if time.monotonic() >= deadline:
                forged = [k for k, (is_set, _) in zip(keys, found) if is_set]
                raise dist.DistStoreError(f"timed out waiting for genuine values at {keys}"
                                          + (f": {forged} hold values that do not verify under the secret"
                                             if forged else ""))
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(2 * pause, REREAD_S)

    def check(self, keys: list[str]) -> bool:
        return all(body is not None for _, body in map(self.read, keys))

    def forged(self, keys: list[str]) -> list[str]:
        """The keys of `keys` that are set but hold a value that does not verify."""
        return [k for k in keys if self.read(k) == (True, None)]

    def compare_set(self, key: str, expected, desired) -> bytes:
        """As the Store's, on genuine values: `expected` b"" means "not set"; the
        answer is the value now there (DistStoreError if it does not verify)."""
        raw = self.inner.compare_set(key, self._tagged(key, expected) if len(expected) else b"",
                                     self._tagged(key, desired))
        body = self._open(key, raw)
        if body is None:
            raise dist.DistStoreError(f"compare_set at {self._context(key)}: the value there does not verify")
        return body

    def append(self, key: str, value) -> None:
        raise NotImplementedError("AuthenticatedStore: append would break the tag of the value it extends")

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)
        dist.Store.set_timeout(self, timeout)

    def clone(self) -> "AuthenticatedStore":
        return AuthenticatedStore(self.inner.clone(), self._secret, self._label)
