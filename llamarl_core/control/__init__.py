"""The control plane: how the processes of a run talk and trust each other.

- auth.py: the run's secret and the HMAC tag every value in the Store carries
  (`new_secret`, `secret_from_env`, `AuthenticatedStore`).
- wire.py: messages as data only (JSON and raw bytes), never unpickled.
- queues.py: `StoreQueue`, a first-in first-out queue of messages over a Store.
- heartbeat.py: `Heartbeat` / `HeartbeatWatch`, whether a process is still there.

It knows nothing of the pipeline, the weight sync or the models that run on it:
they build on it (tests/test_layers.py holds the rule).
"""

from .auth import SECRET_ENV, SECRET_FILE_ENV, AuthenticatedStore, new_secret, secret_from_env
from .heartbeat import Heartbeat, HeartbeatWatch
from .queues import QueueClosed, StoreQueue
from .wire import WireError

__all__ = ["SECRET_ENV", "SECRET_FILE_ENV", "AuthenticatedStore", "Heartbeat", "HeartbeatWatch", "QueueClosed",
           "StoreQueue", "WireError", "new_secret", "secret_from_env"]
