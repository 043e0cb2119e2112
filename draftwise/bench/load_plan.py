"""The load plan behind `draftwise loadgen`: what a run sends, at which concurrencies, in what order, and each
cell's request body. loadgen_command.py turns the command's options into one LoadPlan; loadgen.py drives it."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

from draftwise.bench.interleave import order_for_repeat
from draftwise.errors import DraftwiseError

# on: the server's default speculation (its draft length adapts to acceptance and load); always: the same method
# drafting its full k every round (adaptive off); off: the target alone.
MODES = ("on", "always", "off")
OFF = "off"
SEED_SPAN = 2**32  # llama.cpp takes a seed as uint32; a request's seed stays within it


@dataclass(frozen=True)
class LoadPlan:
    """Everything a run needs, checked: what add_loadgen's options become."""

    url: str
    levels: tuple[int, ...]
    modes: tuple[str, ...]
    prompts: tuple  # BenchPrompt
    requests: int | None = None
    max_tokens: int = 64
    chat: bool = True
    methods: tuple[str | None, ...] = (None,)  # None: the server's own
    repeats: int = 1
    slices: int = 1  # each cell's requests run in this many slices, the modes interleaved slice by slice
    model: str | None = None
    api_key: str | None = None
    timeout: float = 300.0
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # sampled runs only: sent so that no server's own default truncates the distribution
    seed: int = 0  # sampled runs: request i of a level sends request_seed(i)
    server: str = "auto"  # what the server is taken for (load_server.SERVER_CHOICES)

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def request_seed(self, index: int) -> int | None:
        """The seed of a level's request `index` (a warm-up's, of its position): the same at every level, cell and
        repeat, so that where a server honours seeds a run repeats and its cells draw alike; None when greedy."""
        return (self.seed + index) % SEED_SPAN if self.sampled else None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def count(self, level: int) -> int:
        """Requests at this level. Every level sends the same ones (prompts cycled in order), so that a ratio
        between levels compares load, not prompt mixes; fewer than the concurrency would never reach it."""
        return max(self.requests or max(len(self.prompts), *self.levels), level)

    def blocks(self) -> list[list[tuple[str, str | None]]]:
        """The (mode, method) cells every level runs, a block per method of its modes side by side, off among them
        (the target alone, tagged with the block's method: what that method's on is judged against)."""
        return [[(mode, method) for mode in self.modes] for method in self.methods]

    def parts(self, level: int) -> list[range]:
        """The requests of each slice of a cell at this level (indices into the level's count), in order: the count
        cut into `slices` near-equal consecutive runs, or fewer where a slice would hold fewer requests than the
        concurrency (it could never reach it)."""
        count = self.count(level)
        n = max(1, min(self.slices, count // level))
        bounds = [count * i // n for i in range(n + 1)]
        return [range(low, high) for low, high in zip(bounds, bounds[1:])]

    def schedule(self, level: int) -> Iterator[tuple[int, int, str, str | None]]:
        """Every run at a level, (repeat, slice, mode, method), in the order they go: each repeat's blocks as
        order_for_repeat orders them, and within a block, slice by slice, its cells side by side, mirrored from one
        slice (or repeat) to the next. With one slice a block's cells are as far apart as a whole cell takes, long
        enough for a shared machine's speed to move (docs/experiments/constants/README.md); slices bring an on and
        its off within seconds of each other, and give the drift as many mirrored pairs to cancel in."""
        parts = len(self.parts(level))
        for repeat in range(self.repeats):
            for block in order_for_repeat(self.blocks(), repeat):
                for part in range(parts):
                    for mode, method in order_for_repeat(block, repeat * parts + part):
                        yield repeat, part, mode, method


def base_url(url: str) -> str:
    """'http://host:8000/v1/' -> 'http://host:8000': OpenAI clients are given the /v1 form, we add paths to it."""
    parsed = urlparse(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise DraftwiseError(f"--url must be an http:// or https:// address like http://127.0.0.1:8000, got {url!r}")
    path = parsed.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{parsed.scheme}://{parsed.netloc}{path}"


def method_speculation(method: str) -> dict:
    """'hybrid' -> {"method": "hybrid"}; 'hybrid:NAME@v1' -> the same method drafting with NAME@v1, a draft version
    loaded beside the server's own (a trial's candidate), so that two drafts compare in one server, interleaved."""
    name, _, draft = method.partition(":")
    return {"method": name, "draft": draft} if draft else {"method": name}


def request_body(model: str, plan: LoadPlan, mode: str, method: str | None = None,
                 speculation: bool = True, extra: dict | None = None) -> dict:
    """The body shared by a cell's requests (method: what mode on or always asks for; None, the server's own); the
    prompt and seed go in per request. speculation=False: a server that is not draftwise, sent OpenAI's fields alone
    (plus `extra`, the fields its kind is known to take), never draftwise's `speculation`."""
    body = {"model": model, "max_tokens": plan.max_tokens, "temperature": plan.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if plan.sampled:
        body["top_p"] = plan.top_p
    body.update(extra or {})
    if not speculation:
        return body
    if mode == OFF:
        body["speculation"] = {"method": "none"}
        return body
    asked = method_speculation(method) if method else {}
    if mode == "always":
        asked["adaptive"] = False
    if asked:
        body["speculation"] = asked
    return body


def with_prompt(body: dict, text: str, chat: bool, seed: int | None = None) -> dict:
    body = dict(body, seed=seed) if seed is not None else body
    return dict(body, messages=[{"role": "user", "content": text}]) if chat else dict(body, prompt=text)
