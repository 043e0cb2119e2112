"""Frozen settings for one generation. Checked once, before any work starts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from draftwise.errors import DraftwiseError

if TYPE_CHECKING:  # (grammar.py imports the engine's types, which need nothing of this module)
    from draftwise.grammar import Grammar

# The defaults every surface shares (the CLI's commands, the server, Engine.stream, the bench): each is set here only.
DEFAULT_DRAFT_TOKENS = 4  # k: the most draft tokens a round proposes
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_LOOKUP_NGRAM = 3  # the longest n-gram prompt lookup matches
MAX_DRAFT_TOKENS = 64
# The default pair of the commands that load models themselves (bench, serve): one tokenizer, pulled on first use.
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DTYPES = ("auto", "float32", "bfloat16")  # auto: bfloat16 where the hardware computes it, else float32


SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become probabilities. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self) -> None:
        if not 0.0 <= self.temperature < float("inf"):
            raise DraftwiseError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k < 0:
            raise DraftwiseError(f"top_k must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise DraftwiseError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise DraftwiseError(f"seed must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]}, got {self.seed}")


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS  # k: draft tokens proposed per round
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks emit a fixed number of tokens
    adaptive: bool = True  # num_draft_tokens is the most per round; the engine picks k from measured cost and acceptance
    # How this sequence speculates (methods.py; the engine checks the name); None: the engine's own, "none": not at all
    method: str | None = None
    grammar: Grammar | None = None  # what the output must match (grammar.py); None: any text
    # Which of the engine's draft models a draft-model method drafts with (Engine.add_draft: a version loaded beside
    # the engine's own, for a rollout); None: the engine's own
    draft: str | None = None

    @classmethod
    def from_options(
        cls, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        temperature: float = SamplingConfig.temperature, top_k: int = SamplingConfig.top_k,
        top_p: float = SamplingConfig.top_p, seed: int | None = None, stop=(),
        ignore_eos: bool = False, adaptive: bool = True, method: str | None = None, grammar: Grammar | None = None,
        draft: str | None = None,
    ) -> "GenerationConfig":
        """The one request config: the keyword options of Engine.stream, the CLI and the server, checked."""
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        cfg = cls(max_new_tokens, num_draft_tokens, sampling, tuple(stop), ignore_eos, adaptive, method, grammar,
                  draft)
        cfg.check()
        return cfg

    def check(self) -> None:
        self.sampling.check()
        if self.max_new_tokens < 1:
            raise DraftwiseError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_draft_tokens < 1:
            raise DraftwiseError(f"num_draft_tokens (k) must be >= 1, got {self.num_draft_tokens}")
        if self.num_draft_tokens > MAX_DRAFT_TOKENS:
            raise DraftwiseError(
                f"num_draft_tokens (k) must be between 1 and {MAX_DRAFT_TOKENS}, got {self.num_draft_tokens}"
            )
        if self.grammar is not None and self.ignore_eos:
            raise DraftwiseError("ignore_eos cannot be combined with a grammar: a text that completes the grammar "
                                 "ends there")
        if any(not s for s in self.stop):
            raise DraftwiseError("stop strings must be non-empty")
