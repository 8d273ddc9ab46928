"""VariableTracking: assignment chains across chunks; the answer is every variable holding a value.

RULER's variable tracking, compact: ``fig = 4821 .`` in one chunk, ``oak = fig .`` in a later one
(or later in the same chunk), ...; the question ``which variables hold 4821 ?`` asks for ``fig
oak``. The memory must carry a growing set: a variable assigned from one in the set joins it. Other
chains (``distractor_chains``) assign other values through other variables, so a variable that
copies a variable outside the set does not hold the value; distractor sentences
(``distractor_similarity``) assign unrelated variables. The oracle keeps the names of the set, as
many as the budget holds, and answers them. Knobs: ``hops`` (variables in the chain, default 2),
``distractor_chains`` (default 1), the shared ones of
:class:`memgym.generators.memory_tasks.MemoryTaskConfig`.
"""

from __future__ import annotations

import random
import re
from typing import Any

from memgym.generators.memory_tasks import Drawn, MemoryTaskConfig, causal, make_source_for, need, spread
from memgym.generators.planning import PlacedFact

VARIABLES = ("ash bay cod den elm fig gem hut ink jar kit lid map net oak pod rag sap tub urn vat wax yam zip "
             "arc bun cup dot eel fog gum hen ivy jam keg log mud nut orb pin rim tar").split()
QUESTION = "which variables hold {value} ?"
WORDS = ("which", "variables", "hold", "=") + tuple(VARIABLES)
MAX_HOPS = 8
_ASSIGNMENT = re.compile(r"(?<!\w)(\w+) = (\w+) \.")


class ChainScript:
    """Keep the names holding the value (a growing set), in the order they joined; answer them."""

    def __init__(self, value: str, chain: list[str]):
        self.value, self.chain = value, chain

    def held(self, memory: str) -> list[str]:
        return [w for w in dict.fromkeys(memory.split()) if w in VARIABLES]

    def update(self, memory: str, chunk: str) -> list[str]:
        names = self.held(memory)
        for lhs, rhs in _ASSIGNMENT.findall(chunk):
            if lhs in VARIABLES and lhs not in names and (rhs == self.value or rhs in names):
                names.append(lhs)
        return names

    def answer(self, memory: str) -> str:
        return " ".join(self.held(memory))

    def missing(self, memory: str) -> list[str]:
        held = self.held(memory)
        return [v for v in self.chain if v not in held]


class VariableTracking:
    name = "VariableTracking"
    defaults: dict[str, Any] = {"hops": 2, "distractor_chains": 1}

    def check(self, cfg: MemoryTaskConfig) -> None:
        hops, others = cfg.options["hops"], cfg.options["distractor_chains"]
        need(isinstance(hops, int) and not isinstance(hops, bool) and 1 <= hops <= MAX_HOPS, self.name, "hops",
             hops, f"an int in 1..{MAX_HOPS}")
        need(isinstance(others, int) and not isinstance(others, bool) and others >= 0
             and hops * (others + 1) + 2 <= len(VARIABLES), self.name, "distractor_chains", others,
             f"an int >= 0 with hops * (distractor_chains + 1) <= {len(VARIABLES) - 2}")

    def draw(self, rng: random.Random, cfg: MemoryTaskConfig, slots: int) -> Drawn:
        hops, others = cfg.options["hops"], cfg.options["distractor_chains"]
        names = rng.sample(VARIABLES, hops * (others + 1) + 2)
        values = [str(v) for v in rng.sample(range(1000, 10000), others + 1)]
        chains = [names[k * hops:(k + 1) * hops] for k in range(others + 1)]
        free = names[hops * (others + 1):]  # the distractor sentences' variables: never in a chain
        facts: list[PlacedFact] = []
        where = spread(rng, hops * (others + 1), cfg.num_chunks)  # every chain's facts in distinct chunks
        rng.shuffle(where)
        for k, (chain, value) in enumerate(zip(chains, values)):
            chunks = sorted(where[k * hops:(k + 1) * hops])
            rhs = [value] + chain[:-1]
            facts += causal([PlacedFact(chunk=c, slot=rng.randrange(slots), order=k + h / (hops + 1),
                                        text=f"{v} = {r} .") for h, (c, v, r) in enumerate(zip(chunks, chain, rhs))])

        def distractor(r: random.Random) -> str:  # variables outside every chain, values other than the asked one
            number = r.randrange(1000, 10000)
            return f"{free[0]} = {free[1] if r.random() < 0.5 or str(number) == values[0] else number} ."

        target = [f for f in facts if f.text.split()[0] in chains[0]]
        return Drawn(question=QUESTION.format(value=values[0]), answers=[" ".join(chains[0])], facts=facts,
                     supporting_facts=[{"variable": f.text.split()[0], "chunk": f.chunk, "text": f.text}
                                       for f in target],
                     oracle=ChainScript(values[0], chains[0]), distractor=distractor,
                     metadata={"value": values[0], "chain": chains[0], "distractor_chains": chains[1:],
                               "distractor_values": values[1:]})


TASK = VariableTracking()


make_source = make_source_for(TASK)
