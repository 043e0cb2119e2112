"""The one exception type users see: a message that says what is wrong and what is allowed."""


class DraftwiseError(Exception):
    """A user-facing error. The CLI prints its message and exits non-zero, never a traceback."""


class ModelStoreError(DraftwiseError):
    """Pulling, checking or finding a model failed."""
