"""The exceptions of a weight sync, in a module of their own so that the engine
(engine.py) can raise them without importing the endpoints that use it."""


class SyncError(RuntimeError):
    """A weight sync failed."""


class SyncTimeoutError(SyncError, TimeoutError):
    """A peer did not answer within the timeout."""


class TornWeightsError(SyncError):
    """The receiver's tensors hold a partly written version and must not be used."""
