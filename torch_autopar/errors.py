"""User-facing error type of torch_autopar.

Every error a user can cause is an `AutoparError` whose message starts with ``torch_autopar:`` and says what
was expected, what was found and how to fix it. This module must never import torch or any stage.
"""

PREFIX = "torch_autopar: "


class AutoparError(RuntimeError):
    """A mistake in how torch_autopar was called or configured; the message says how to fix it."""

    def __init__(self, message: str):
        super().__init__(message if message.startswith(PREFIX) else PREFIX + message)
