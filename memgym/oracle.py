"""Oracle scripts: how a scripted oracle solves one sample from its own memory.

A task that knows how its questions are solved gives each :class:`~memgym.data.Sample` an
``oracle`` script; a sample without one is solved by :class:`FactsScript`, from its
``supporting_facts``. The oracle agent (``agents.oracle.OracleAgent``) drives the script: after
each chunk it asks :meth:`OracleScript.update` for the next memory (as items, most needed first),
keeps the longest run of whole items the memory budget holds, and at the end answers with
:meth:`OracleScript.answer` of the memory the env holds. A script reads only the memory text and
the chunk, never the gold answer at answer time: an oracle whose budget cannot hold what the
answer needs does not answer right, and :meth:`OracleScript.missing` says what it lacked.
"""

from __future__ import annotations

import re
from typing import Callable, Protocol, Sequence, runtime_checkable


@runtime_checkable
class OracleScript(Protocol):
    """Solves one sample from the memory alone (see the module doc)."""

    def update(self, memory: str, chunk: str) -> list[str]:
        """The items of the next memory, most needed first, from the memory the env holds and the
        new chunk; the oracle joins the longest run of them that fits the budget with spaces."""
        ...

    def answer(self, memory: str) -> str:
        """The answer, read from the memory text alone (``""`` when it cannot answer)."""
        ...

    def missing(self, memory: str) -> list[str]:
        """What the final memory lacks for the right answer (empty when it holds all of it)."""
        ...


def contains(text: str, item: str) -> bool:
    """``item`` occurs in ``text`` as whole words (``"al ice ."`` must not match ``"mal ice ."``)."""
    return re.search(r"(?<!\w)" + re.escape(item) + r"(?!\w)", text) is not None


class EachOf:
    """Several keys asked at once, a script each: the memory holds their items in the question's
    order, the answer is the answers of the keys the memory still knows (``known`` says one, or
    ``""``: a key it lost is left out, not guessed), and what it lacks is what each lacks."""

    def __init__(self, scripts: Sequence[OracleScript], known: Callable[[OracleScript, str], str]):
        self.scripts, self.known = list(scripts), known

    def update(self, memory: str, chunk: str) -> list[str]:
        return [item for s in self.scripts for item in s.update(memory, chunk)]

    def answer(self, memory: str) -> str:
        return " ".join(a for a in (self.known(s, memory) for s in self.scripts) if a)

    def missing(self, memory: str) -> list[str]:
        return [item for s in self.scripts for item in s.missing(memory)]


class FactsScript:
    """The default script: keep the supporting-fact sentences verbatim, in reading order; answer
    the gold answer when the memory holds every one of them, else nothing.

    That the facts imply the answer is the task's claim (its ``supporting_facts``); the script only
    checks that the memory holds them all when it answers.
    """

    def __init__(self, facts: Sequence[str], answer: str):
        self.facts = list(facts)
        self.gold = answer

    def update(self, memory: str, chunk: str) -> list[str]:
        held = sorted((f for f in self.facts if contains(memory, f)), key=memory.find)
        return held + [f for f in self.facts if f not in held and contains(chunk, f)]

    def answer(self, memory: str) -> str:
        return self.gold if not self.missing(memory) else ""

    def missing(self, memory: str) -> list[str]:
        return [f for f in self.facts if not contains(memory, f)]


class ReaderScript:
    """The supporting facts kept as a reader of the text could keep them, not knowing which sentence
    is true: each fact's *frame* is the fact with the answer's words as blanks (``karl ___ .`` for
    ``karl aperture .``, when the question asks where karl works); per frame, the memory keeps the
    newest sentence that fills it (the chunk's over the memory's), and the answer is read from the
    memory's fillers.

    On clean input it writes what :class:`FactsScript` writes (only the facts fill their frames).
    They part where the memory holds a wrong sentence of a frame (a perturbation, a wrong write):
    :class:`FactsScript` knows the true facts and drops it (privileged: no reader of the text could
    tell it was wrong), this script keeps it and answers from it until the chunk fills the frame
    again, then takes the chunk's sentence. Its trajectories from perturbed states therefore show a
    recovery a model can learn from its inputs.
    """

    def __init__(self, facts: Sequence[str], answer: str):
        self.facts = list(facts)
        self.gold = answer.split()
        blanks = set(self.gold)
        self.frames = [re.compile(r"(?<!\w)" + r"\s+".join(r"(\S+)" if w in blanks else re.escape(w)
                                                            for w in fact.split()) + r"(?!\w)")
                       for fact in self.facts]

    def _newest(self, frame: re.Pattern[str], text: str) -> re.Match[str] | None:
        found = None
        for found in frame.finditer(text):
            pass
        return found

    def update(self, memory: str, chunk: str) -> list[str]:
        held, new = [], []  # FactsScript's order: the memory's frames where they stand, then the chunk's
        for frame in self.frames:
            old, fresh = self._newest(frame, memory), self._newest(frame, chunk)
            if old is not None:
                held.append((old.start(), (fresh or old).group(0)))
            elif fresh is not None:
                new.append(fresh.group(0))
        items = [text for _, text in sorted(held)] + new
        return [t for k, t in enumerate(items) if t not in items[:k]]

    def answer(self, memory: str) -> str:
        fillers: dict[str, str] = {}
        for fact, frame in zip(self.facts, self.frames):
            match = self._newest(frame, memory)
            if match is None:
                return ""
            blanks = [w for w in fact.split() if w in self.gold]
            fillers.update(zip(blanks, match.groups()))
        return " ".join(fillers.get(w, w) for w in self.gold)

    def missing(self, memory: str) -> list[str]:
        return [f for f in self.facts if not contains(memory, f)]


__all__ = ["FactsScript", "OracleScript", "ReaderScript", "contains"]
