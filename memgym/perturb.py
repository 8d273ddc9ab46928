"""The perturbed-memory control: replace the memory the next call reads by a plausible wrong one.

On-policy distillation's premise is that a student's own mistakes lead to states imitation data
never shows (a memory holding a distractor, a stale value, a dropped fact). :class:`MemoryPerturbation`
wraps any memgym env and puts such a state before a call on purpose: after the memory write of a
chosen chunk (or of each chunk with a probability), the env's memory becomes

- ``drop``: empty (the fact dropped);
- ``stale``: the memory before that write (the write is lost: an overwritten value comes back);
- ``distractor``: the memory, or when it holds no answer word the sample's first supporting fact,
  with every word of the gold answer replaced by the answer of another sample of the task (a
  plausible wrong fact for the asked relation: ``alice acme .`` becomes ``alice globex .``).

The replaced memory is cut to the budget like an action, shown in the observation, and flagged in
``info`` (``memory_replaced``, ``perturbation``); an agent adopts it as its memory
(:meth:`agents.policy.MemoryPolicy.sync_memory`), so the next call reads it. A replacement equal to
the memory (dropping an empty one, a write that changed nothing made stale) is no perturbation and
is not recorded. The terminating
step's ``info["perturbations"]`` lists every :class:`Perturbation` of the episode, each saying
whether a supporting fact was read again after it (``reappears``: recovery is possible); the
episode record keeps them (:attr:`agents.records.Episode.perturbations`). The wrapper draws from
its own generator (seeded by ``reset``): an episode it does not perturb is the episode without it.

Spec strings (``--memory-perturbation``): ``KIND`` (once per episode, after a memory write chosen
uniformly), ``KIND@N`` (after the write of chunk ``N``, 0-based), ``KIND@pP`` (after each write
with probability ``P``, e.g. ``stale@p0.25``).
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass
from typing import Any

import gymnasium as gym

KINDS = ("drop", "stale", "distractor")


@dataclass(frozen=True)
class PerturbationSpec:
    """When and how to perturb: ``kind``, and ``after`` (a chunk index), ``probability`` or neither
    (once, at a uniformly chosen write)."""

    kind: str
    after: int | None = None
    probability: float | None = None

    def __str__(self) -> str:
        when = "" if self.after is None and self.probability is None else (
            f"@{self.after}" if self.after is not None else f"@p{self.probability:g}")
        return f"{self.kind}{when}"


def parse_spec(spec: str) -> PerturbationSpec:
    """``KIND``, ``KIND@N`` or ``KIND@pP``; a ``ValueError`` saying what is allowed otherwise."""
    m = re.fullmatch(r"(\w+)(?:@(?:(\d+)|p(\d*\.?\d+)))?", spec.strip()) if isinstance(spec, str) else None
    usage = (f"memory perturbation {spec!r}: give KIND, KIND@N (after chunk N, 0-based) or KIND@pP (each chunk "
             f"with probability P in (0, 1]), KIND one of {', '.join(KINDS)}; e.g. drop@2 or stale@p0.25")
    if m is None or m.group(1) not in KINDS:
        raise ValueError(usage)
    probability = float(m.group(3)) if m.group(3) is not None else None
    if probability is not None and not 0 < probability <= 1:
        raise ValueError(usage)
    return PerturbationSpec(m.group(1), int(m.group(2)) if m.group(2) is not None else None, probability)


@dataclass
class Perturbation:
    """One replaced memory: what was there, what replaced it, after which chunk, and whether a
    supporting fact was read again afterwards (None: the sample names none)."""

    kind: str
    after_chunk: int
    original: str
    replacement: str
    reappears: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Perturbation":
        return cls(**{k: d[k] for k in ("kind", "after_chunk", "original", "replacement") if k in d},
                   reappears=d.get("reappears"))


class MemoryPerturbation(gym.Wrapper):
    """Replaces the memory of a memgym env by a plausible wrong one (see the module doc)."""

    def __init__(self, env: gym.Env, spec: str | PerturbationSpec):
        super().__init__(env)
        self.perturbation = parse_spec(spec) if isinstance(spec, str) else spec
        self._rng = random.Random(0)
        self._done: list[Perturbation] = []
        self._facts: list[str] = []
        self._at: int | None = None
        self._memory = ""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        obs, info = self.env.reset(seed=seed, options=options)
        base = self.env.unwrapped
        self._rng = random.Random(f"memgym-perturbation/{seed}/{info['sample_id']}")
        self._done, self._memory = [], ""
        self._facts = _fact_texts(base.sample)
        n = int(info["num_chunks"])
        self._at = self.perturbation.after if self.perturbation.after is not None else (
            self._rng.randrange(n) if self.perturbation.probability is None and n else None)
        return obs, info

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict]:
        before = self._memory
        obs, reward, terminated, truncated, info = self.env.step(action)
        chunk_index = int(info["chunk_index"]) - 1  # the chunk whose memory was just written
        if info["phase"] in ("memory", "answer") and chunk_index >= 0 and self._due(chunk_index):
            obs, info = self._perturb(chunk_index, before, obs, info)
        if self._done and info.get("chunk"):  # the next chunk is read after every perturbation so far
            seen = any(_holds(info["chunk"], f) for f in self._facts)
            for p in self._done:  # a supporting fact read again: recovery is possible
                p.reappears = None if p.reappears is None else (p.reappears or seen)
        self._memory = info.get("memory", "")
        if terminated and self._done:
            info = {**info, "perturbations": [p.to_dict() for p in self._done]}
        return obs, reward, terminated, truncated, info

    def _due(self, chunk_index: int) -> bool:
        if self.perturbation.probability is not None:
            return self._rng.random() < self.perturbation.probability
        return chunk_index == self._at

    def _perturb(self, chunk_index: int, before: str, obs: Any, info: dict[str, Any]) -> tuple[Any, dict]:
        original = info["memory"]
        text = {"drop": "", "stale": before}.get(self.perturbation.kind)
        if text is None:
            text = self._distractor(original)
        if text == original:  # nothing to replace (an empty memory dropped, an unchanged one made stale)
            return obs, info
        obs, info = self.env.unwrapped.replace_memory(text)
        record = Perturbation(self.perturbation.kind, chunk_index, original, info["memory"],
                              reappears=False if self._facts else None)
        self._done.append(record)
        return obs, {**info, "memory_replaced": True, "perturbation": record.to_dict()}

    def _distractor(self, memory: str) -> str:
        """The memory (or the first supporting fact) with the gold answer's words replaced by those of
        another sample's answer."""
        base = self.env.unwrapped
        gold = str(base.sample.answers[0]).split()
        wrong = self._other_answer(" ".join(gold)).split()
        text = memory if any(_holds(memory, w) for w in gold) or not self._facts else self._facts[0]
        mapping = {g: wrong[k % len(wrong)] for k, g in enumerate(gold)} if wrong else {}
        pattern = re.compile(r"(?<!\w)(" + "|".join(re.escape(g) for g in gold) + r")(?!\w)") if gold else None
        return pattern.sub(lambda m: mapping.get(m.group(1), m.group(1)), text) if pattern else text

    def _other_answer(self, gold: str) -> str:
        source = self.env.unwrapped.source
        for _ in range(32):
            answer = str(source[self._rng.randrange(len(source))].answers[0])
            if answer.lower() != gold.lower():
                return answer
        return ""


def _holds(text: str, item: str) -> bool:
    return bool(item) and re.search(r"(?<!\w)" + re.escape(item) + r"(?!\w)", text) is not None


def _fact_texts(sample: Any) -> list[str]:
    out = []
    for fact in getattr(sample, "supporting_facts", None) or ():
        text = fact.get("text") if isinstance(fact, dict) else fact if isinstance(fact, str) else None
        if isinstance(text, str) and text.strip():
            out.append(text.strip())
    return out


__all__ = ["KINDS", "MemoryPerturbation", "Perturbation", "PerturbationSpec", "parse_spec"]
