"""Errors that cross layers (tier 0)."""


class EngineOverloadedError(Exception):
    """The engine refused or dropped a request because of load (HTTP 429 when the queue is full, 503 when a
    request waited longer than its maximum queue delay)."""

    def __init__(self, message: str, status: int, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class EngineFatalError(RuntimeError):
    """The engine cannot go on (e.g. a tensor-parallel worker died): not retried request by request, it stops the
    engine loop."""


class TensorParallelError(EngineFatalError):
    """A tensor-parallel rank died, hung past the timeout, or fell out of step with the others."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it died, or was shut down): no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed while computing this request; other requests go on."""
