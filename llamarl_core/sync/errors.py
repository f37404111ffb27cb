"""The exceptions of a weight sync, in a module of their own so that the engine
(engine.py) can raise them without importing the sender and receiver that use it."""


class SyncError(RuntimeError):
    """A weight sync failed."""


class SyncTimeoutError(SyncError, TimeoutError):
    """A peer did not answer within the timeout."""


class TornWeightsError(SyncError):
    """The receiver's tensors hold a partly written version and must not be used."""


class StaleReceiveError(SyncError):
    """The version a receive asked for will not come (its sender died and a restarted
    one holds a newer version); no sender wrote: the receiver's weights are as
    they were."""


class RelayError(SyncError):
    """A version landed on this generator replica, but relaying it to some of the
    replicas it feeds failed. version: the version that landed here (the receiver
    holds it, not torn); failed: child replica -> what went wrong."""

    def __init__(self, message: str, version: int, failed: dict[int, str]):
        super().__init__(message)
        self.version, self.failed = version, failed
