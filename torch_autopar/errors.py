"""User-facing error type of torch_autopar.

Every error a user can cause is an `AutoparError` whose message starts with ``torch_autopar:`` and says what
was expected, what was found and how to fix it. This module must never import torch or any stage.
"""

PREFIX = "torch_autopar: "


class AutoparError(RuntimeError):
    """A mistake in how torch_autopar was called or configured; the message says how to fix it."""

    def __init__(self, message: str):
        super().__init__(message if message.startswith(PREFIX) else PREFIX + message)


class RankFailureError(AutoparError):
    """A collective failed because another rank died or stopped calling collectives.

    ``step`` is the compiled module's forward-call count when it happened; ``missing_ranks`` the ranks that did
    not answer a roll call afterwards (None when the job's store could not tell)."""

    def __init__(self, message: str, *, step: int | None = None, missing_ranks: list | None = None):
        super().__init__(message)
        self.step = step
        self.missing_ranks = missing_ranks

    def __reduce__(self):  # picklable with its fields (ranks report errors to their parent as data)
        return (_rebuild_rank_failure, (str(self), self.step, self.missing_ranks))


def _rebuild_rank_failure(message, step, missing_ranks):
    return RankFailureError(message, step=step, missing_ranks=missing_ranks)
