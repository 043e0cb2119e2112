"""Hugging Face transformers as a backend: any causal LM, a DynamicCache that crops to rewind."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from draftwise.errors import DraftwiseError
from draftwise.hardware import resolve_dtype
from draftwise.progress import transformers_progress

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class HFBackend:
    def __init__(self, model: PreTrainedModel):
        self.model = model.eval()
        config = model.config.get_text_config()
        self.vocab_size: int = model.get_output_embeddings().out_features  # a packed head has no plain .weight
        self.max_context: int = int(getattr(config, "max_position_embeddings", 1 << 30))
        self._cache = _new_cache()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def cache_len(self) -> int:
        return self._cache.get_seq_length()

    def prefill(self, token_ids: list[int]) -> None:
        self._cache = _new_cache()
        if token_ids:
            # Only the cache matters here, so skip the vocab-wide projection of every prompt position.
            self._run(token_ids, logits_to_keep=1)

    def forward(self, new_token_ids: list[int]) -> torch.Tensor:
        logits = self._run(new_token_ids, logits_to_keep=len(new_token_ids))  # [1, n, vocab]
        return logits[0].float()  # [n, vocab]

    def trim(self, to_len: int) -> None:
        # Layer by layer to an absolute length: a forward interrupted midway leaves layers of unequal length.
        for layer in self._cache.layers:
            extra = layer.get_seq_length() - to_len if layer.is_initialized else 0
            if extra > 0:
                layer.crop(-extra)

    @torch.inference_mode()
    def _run(self, token_ids: list[int], logits_to_keep: int) -> torch.Tensor:
        start = self.cache_len
        if start + len(token_ids) > self.max_context:
            raise DraftwiseError(
                f"sequence of {start + len(token_ids)} tokens exceeds the model's context of {self.max_context}"
            )
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        # Positions and a full mask given outright, as generate() does: the model then builds no defaults per step.
        positions = torch.arange(start, start + len(token_ids), device=self.device)  # [n]
        mask = torch.ones(1, start + len(token_ids), dtype=torch.long, device=self.device)  # [1, cache + n]
        out = self.model(input_ids=input_ids, past_key_values=self._cache, use_cache=True, attention_mask=mask,
                         cache_position=positions, logits_to_keep=logits_to_keep)
        return out.logits


def _new_cache() -> DynamicCache:
    # No config on purpose: with one, sliding-window models get layers that refuse to crop once the
    # window fills, and every rejection would fail. The model's attention mask applies the window anyway.
    return DynamicCache()


def torch_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """The torch dtype of a dtype name; 'auto' resolves for device (see hardware.py)."""
    return _TORCH_DTYPES[resolve_dtype(name, device)]


def load_tokenizer(path: str, gguf_file: str | None = None):
    """The tokenizer alone: seconds, so a draft/target mismatch is caught before a model loads."""
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        raise DraftwiseError(f"could not load a tokenizer from {path}: {err}") from err


def load_model(path: str, gguf_file: str | None = None, dtype: str = "auto", device: str = "cpu",
               progress: bool = True) -> PreTrainedModel:
    """A causal LM from a local folder, or a .gguf file inside it, cast to dtype."""
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        with transformers_progress(progress):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype, device), **kwargs)
    except (OSError, ValueError) as err:
        raise DraftwiseError(f"could not load a causal language model from {path}: {err}") from err
    return model.to(device)


def load_hf(path: str, gguf_file: str | None = None, dtype: str = "auto", device: str = "cpu", progress: bool = True):
    """(model, tokenizer) from a local folder, or a .gguf file inside it."""
    return load_model(path, gguf_file, dtype, device, progress), load_tokenizer(path, gguf_file)
