"""draftwise: speculative decoding that never changes what the target model generates."""
from draftwise.errors import DraftwiseError

__version__ = "0.1.0"
__all__ = ["Engine", "Result", "DraftwiseError", "__version__"]


def __getattr__(name: str):
    # The engine imports torch (seconds); `draftwise --help` and `models list` should not wait for it.
    if name in ("Engine", "Result"):
        from draftwise import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'draftwise' has no attribute {name!r}")
