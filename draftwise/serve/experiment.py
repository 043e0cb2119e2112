"""`draftwise serve --experiment arms.toml`: A/B arms, speculation configurations that share the live traffic.

Each request that does not set `speculation` itself is served by one arm, picked by weight; the arm labels its
metrics, its proposal log rows and its response, so the arms can be compared on the same load (`draftwise log
stats` has a table per arm). An arms file:

    by = "user"        # optional: a request field; the same value always gets the same arm
    [[arm]]
    name = "draft-k4"
    weight = 2         # optional, 1 by default: shares of the traffic are weight / total weight
    speculation = { method = "draft", num_draft_tokens = 4 }
    [[arm]]
    name = "off"
    speculation = "off"

`speculation` takes what the request field takes (protocol.speculation_options checks both). A request that
sets it is served as it asks, under the arm "request": its own choice is not a sample of any arm.
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from draftwise.methods import method_names
from draftwise.errors import DraftwiseError
from draftwise.serve.protocol import RequestError, speculation_options

REQUEST_ARM = "request"
FILE_KEYS = ("by", "arm")
ARM_KEYS = ("name", "weight", "speculation")


@dataclass(frozen=True)
class Arm:
    name: str
    weight: float
    speculation: object  # as a request's `speculation` field: "off", or {method, num_draft_tokens, adaptive}


class Experiment:
    def __init__(self, arms: list[Arm], by: str | None = None, rng: random.Random | None = None, source: str = ""):
        self.arms, self.by, self.source = arms, by, source
        self.rng = rng or random.Random()  # seeded in tests
        total = sum(arm.weight for arm in arms)
        self._bounds = list(itertools.accumulate(arm.weight / total for arm in arms))  # [0, 1) cut by weight

    @classmethod
    def load(cls, path: str | Path, rng: random.Random | None = None) -> "Experiment":
        """Read and check an arms file; the methods are checked against every method draftwise has, and
        against the loaded engine's with check()."""
        return cls.parse(_read_toml(Path(path)), str(path), rng)

    @classmethod
    def parse(cls, data: dict, source: str = "the arms file", rng: random.Random | None = None) -> "Experiment":
        _refuse_unknown(data, FILE_KEYS, source)
        by = data.get("by")
        if by is not None and (not isinstance(by, str) or not by):
            raise DraftwiseError(f"{source}: 'by' must be the name of a request field, e.g. \"user\"; got {by!r}")
        arms = data.get("arm")
        if not isinstance(arms, list) or not arms or not all(isinstance(a, dict) for a in arms):
            raise DraftwiseError(f"{source}: no arms; give each one an [[arm]] table with a name, a weight and "
                                 "speculation")
        parsed = [_arm(a, i, source) for i, a in enumerate(arms)]
        seen = set()
        for arm in parsed:
            if arm.name in seen:
                raise DraftwiseError(f"{source}: two arms are named {arm.name!r}; each name labels one arm's "
                                     "metrics and log rows")
            seen.add(arm.name)
        if not math.isfinite(sum(arm.weight for arm in parsed)):  # each finite, their sum past a float: no shares
            raise DraftwiseError(f"{source}: the arms' weights add up past a float's range; give smaller weights "
                                 "(only their ratios count)")
        experiment = cls(parsed, by, rng, source)
        experiment.check(method_names())
        return experiment

    def check(self, methods_available) -> None:
        """Every arm's speculation is one these methods can serve (the engine's, once it has loaded)."""
        for arm in self.arms:
            _check_speculation(arm.speculation, arm.name, methods_available, self.source)

    @property
    def labels(self) -> tuple[str, ...]:
        """Every arm a request can be served under."""
        return (*(arm.name for arm in self.arms), REQUEST_ARM)

    def assign(self, body: dict) -> tuple[str, object]:
        """(arm name, the `speculation` value the request is served with)."""
        if body.get("speculation") is not None:
            return REQUEST_ARM, body["speculation"]
        arm = self.pick(body.get(self.by) if self.by else None)
        return arm.name, arm.speculation

    def pick(self, key=None) -> Arm:
        """The arm for this value of the `by` field: the same value always gets the same arm, and values spread
        over the arms by weight; without one (None), a random draw by weight."""
        point = self.rng.random() if key is None else _unit_hash(key)
        return self.arms[min(bisect.bisect_right(self._bounds, point), len(self.arms) - 1)]

    def describe(self) -> str:
        total = sum(arm.weight for arm in self.arms)
        shares = ", ".join(f"{arm.name} {100 * arm.weight / total:.0f}%" for arm in self.arms)
        return f"{shares}{f' (by {self.by})' if self.by else ''}"


def _read_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError as err:  # Python 3.10
        raise DraftwiseError("--experiment reads TOML with tomllib, which needs Python 3.11 or newer") from err
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise DraftwiseError(f"cannot read the arms file {path}: {err}") from err
    except tomllib.TOMLDecodeError as err:
        raise DraftwiseError(f"{path} is not valid TOML: {err}") from err


def _arm(table: dict, index: int, source: str) -> Arm:
    where = f"{source}: arm {index + 1}"
    name = table.get("name")
    if not isinstance(name, str) or not name.strip():
        raise DraftwiseError(f"{where} needs a name (a non-empty string)")
    if name == REQUEST_ARM:
        raise DraftwiseError(f"{where}: the name {REQUEST_ARM!r} is taken by requests that set their own "
                             "speculation; choose another")
    where = f"{source}: arm {name!r}"
    _refuse_unknown(table, ARM_KEYS, where)
    weight = table.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise DraftwiseError(f"{where}: the weight must be a number > 0, got {weight!r}")
    if "speculation" not in table:
        raise DraftwiseError(f"{where} needs speculation: \"off\", or a table such as {{ method = \"lookup\" }} "
                             "(what a request's speculation field takes)")
    return Arm(name, float(weight), table["speculation"])


def _check_speculation(speculation, name: str, methods_available, source: str) -> None:
    try:
        speculation_options(speculation, methods_available)
    except RequestError as err:
        raise DraftwiseError(f"{source}: arm {name!r}: {err}") from err


def _refuse_unknown(table: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise DraftwiseError(f"{where}: unknown keys {', '.join(unknown)}; allowed: {', '.join(allowed)}")


def _unit_hash(value) -> float:
    """A point of [0, 1) that depends on the value alone: the same in every process and on every run (unlike
    Python's hash, salted per process)."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()  # (JSON may carry a lone surrogate)
    return int.from_bytes(digest[:8], "big") / 2**64
