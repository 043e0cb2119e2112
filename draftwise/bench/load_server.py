"""What server a load run measures: draftwise, llama.cpp's llama-server, or another OpenAI-compatible one.

Only a draftwise server takes the `speculation` field; a strict OpenAI-compatible server may refuse a body with a
field it does not know, and one that ignores it would run its own speculation in every cell, so that "off" would
measure nothing of what it says. So the kind decides what is sent (LoadPlan's request_body) and which modes can
run at all, and the report names the server measured.
"""
from __future__ import annotations

from dataclasses import dataclass

from draftwise.bench.load_plan import LoadPlan
from draftwise.errors import DraftwiseError

DRAFTWISE, LLAMA_CPP, PLAIN = "draftwise", "llama.cpp", "plain"
SERVER_CHOICES = ("auto", DRAFTWISE, PLAIN)  # --server: what the server is taken for; auto asks it


@dataclass(frozen=True)
class ServerKind:
    kind: str  # DRAFTWISE, LLAMA_CPP or PLAIN
    name: str  # for the report: "llama.cpp llama-server b1234-abcdef"

    @property
    def speculation(self) -> bool:
        """Whether requests may carry draftwise's `speculation` field."""
        return self.kind == DRAFTWISE

    def extra_fields(self, plan: LoadPlan) -> dict:
        """Fields beyond OpenAI's that this kind is known to take. llama-server samples with top-k 40 and min-p 0.05
        unless told otherwise, draftwise from the whole tempered distribution: turned off, both draw from the same
        distribution at the same temperature (its draft acceptance depends on it)."""
        return {"top_k": 0, "min_p": 0.0} if self.kind == LLAMA_CPP and plan.sampled else {}


async def identify(http, listing: dict | None, forced: str = "auto") -> ServerKind:
    """The server's kind: from /v1/models (draftwise says owned_by "draftwise"), else llama-server's GET /props
    (its build_info), else a plain OpenAI-compatible server. listing None (/v1/models not answered, --model given):
    taken for draftwise, what loadgen was made to drive."""
    owner = _owner(listing)
    if forced == DRAFTWISE or (forced == "auto" and (listing is None or owner == DRAFTWISE)):
        said = "" if owner == DRAFTWISE else " (as --server says)" if forced == DRAFTWISE else \
            " (taken for one: /v1/models did not answer)"
        return ServerKind(DRAFTWISE, "draftwise" + said)
    build = await _llama_build(http)
    if build is not None:
        return ServerKind(LLAMA_CPP, f"llama.cpp llama-server {build}")
    return ServerKind(PLAIN, f"an OpenAI-compatible server (owned_by {owner!r})" if owner else
                      "an OpenAI-compatible server")


def check_plan(plan: LoadPlan, server: ServerKind) -> None:
    """Before any request: a server that is not draftwise can run only its own speculation, as it was started."""
    if server.speculation:
        return
    if plan.modes != ("on",) or plan.methods != (None,):
        raise DraftwiseError(
            f"{plan.url} is {server.name}, not draftwise: it takes no `speculation` field, so run it with "
            f"--speculation on and no --methods (start it once with and once without its draft to compare the two)")


def _owner(listing: dict | None) -> str | None:
    try:
        owner = listing["data"][0].get("owned_by")
    except (TypeError, KeyError, IndexError, AttributeError):
        return None
    return owner if isinstance(owner, str) else None


async def _llama_build(http) -> str | None:
    """llama-server's build_info from GET /props; None from any other server (or one that does not answer)."""
    import httpx

    try:
        response = await http.get("/props")
        props = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    build = props.get("build_info") if isinstance(props, dict) else None
    return build if isinstance(build, str) and build else None
