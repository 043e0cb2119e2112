"""draftwise: speculative decoding that never changes what the target model generates."""
from draftwise.engine import Engine, Result
from draftwise.errors import DraftwiseError

__version__ = "0.1.0"
__all__ = ["Engine", "Result", "DraftwiseError", "__version__"]
