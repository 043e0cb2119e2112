"""What the store makes from a GGUF file: the small files reading it needs (prepare_gguf, at every pull), and a
float32 safetensors folder that `from_pretrained(folder)` loads in seconds (convert_gguf, only for the hf backend).

torch and transformers are imported inside the functions: listing or resolving models stays instant.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from draftwise.models.gguf_file import refuse_rope_factors
from draftwise.progress import transformers_progress


class Convert(Protocol):
    """convert(gguf_dir, gguf_file, out_dir, progress=...): write a Hugging Face folder into out_dir."""

    def __call__(self, gguf_dir: Path, gguf_file: str, out_dir: Path, *, progress: bool) -> None: ...


def load_gguf_as_float32(path: str | Path, gguf_file: str, *, progress: bool = True) -> tuple[Any, Any]:
    """(model, tokenizer) dequantized from `path/gguf_file`, weights in float32.

    float32 on purpose: the GGUF dequantizes to float32 and rounding it to bfloat16 changes greedy text.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with transformers_progress(progress):
        model = AutoModelForCausalLM.from_pretrained(str(path), gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file)
    return model, tokenizer


def save_converted(model: Any, tokenizer: Any, out_dir: Path) -> None:
    """Save a GGUF-loaded model as plain float32 safetensors plus its tokenizer (and generation config).

    The weights are already dequantized in memory, but transformers still marks the model as GGUF-quantized
    and refuses to save it; dropping the marker (config entry and, in transformers 5, the attached quantizer)
    leaves an ordinary float model.
    """
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))  # safetensors by default; also writes generation_config.json
    tokenizer.save_pretrained(str(out_dir))


def convert_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path, *, progress: bool = True) -> None:
    """The real conversion step of a pull (about a minute for 1.5B parameters on 2 cores)."""
    refuse_rope_factors(gguf_dir / gguf_file)  # (a float model without its rotary scaling is not the file's model)
    model, tokenizer = load_gguf_as_float32(gguf_dir, gguf_file, progress=progress)
    save_converted(model, tokenizer, out_dir)


def prepare_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path, *, progress: bool = True) -> None:
    """config.json, generation_config.json and the tokenizer's files of a GGUF file, from its metadata alone (no
    weight is read): what the quant route reads beside the file, and what a tokenizer loads from in a second."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with transformers_progress(progress):
        config = AutoConfig.from_pretrained(str(gguf_dir), gguf_file=gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_file)
    if hasattr(config, "quantization_config"):  # (transformers' marker of a model it would de-quantize)
        del config.quantization_config
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
