"""One exception type for every user-facing failure.

The CLI catches `MiniRunError` and prints its message on one line with a non-zero exit;
anything else is a bug and keeps its traceback.
"""


class MiniRunError(Exception):
    """A bad input or an impossible request, with a message meant for the user."""


class CheckpointError(MiniRunError):
    """A model directory or file that is missing, corrupt or of an unsupported architecture."""


class ContextError(MiniRunError):
    """A prompt or a context size that does not fit."""
