"""A notes agent: after each chunk it *appends* one short note to its memory instead of rewriting it.

MemAgent samples the whole new memory at every chunk, so the memory a call sees is exactly what
the previous call sampled. This agent samples only a note (at most ``note_tokens`` tokens, and
never more than the memory budget has room for); the memory is its earlier notes, as the token
ids they were sampled as, joined by a newline. That matters to the learner:

- a call's memory segment is several earlier actions (plus literal separators), not the last one,
  so the memory span in ``Invocation.spans`` is the only place that says where it is;
- actions are short and a full memory skips the call altogether, so episodes differ in their
  number of calls;
- the prompt layout is its own (``<notes>`` instead of ``<memory>``): a teacher trained on
  MemAgent's layout has not seen it. ``NotesOracle`` writes gold trajectories in this layout, to
  fine-tune a teacher on (see docs/extend.md, "Bring your own agent").

Prompts come from :class:`agents.prompts.PromptBuilder` and requests from
:meth:`MemoryPolicy.request`, so every call is recorded exactly by the backend, with the prompt
segments (``spans["memory"]``) that the persistent-history control removes.

    python -m memopd.eval --agent examples.notes_agent:NotesAgent --model tiny --episodes 8
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from typing import Any

from agents.memagent import default_sampling
from agents.oracle import supporting_texts
from agents.policy import EpisodeState, MemoryPolicy, strip_stop
from agents.prompts import PromptBuilder, PromptTemplate
from agents.records import Invocation

NOTES_TEMPLATE = PromptTemplate(
    name="notes",
    prefix=(
        "You read a long text one section at a time to solve a problem. After each section you add "
        "one short note with the facts from it that help solve the problem, or an empty note when it "
        "has none; your earlier notes stay as they are. At the end you answer the problem from your "
        "notes alone.\n\n<problem>\n{question}\n</problem>\n\n"
    ),
    calls={
        "memory": "<notes>\n{memory}\n</notes>\n\n<section>\n{chunk}\n</section>\n\nWrite the new note only.",
        "answer": "<notes>\n{memory}\n</notes>\n\nAnswer the problem from the notes. Write only the answer.",
    },
)
"""The notes layout: problem + notes so far + section -> one new note; problem + notes -> answer."""

SEPARATOR = "\n"
"""Literal text between two notes in the memory."""


class NotesAgent(MemoryPolicy):
    """Appends a bounded note per chunk; answers from the notes.

    Args:
        backend: the model backend (make the env with ``tokenizer=backend.tokenizer`` so the memory
            budget is counted in the same tokens).
        sampling: sampling of note calls; their ``max_new_tokens`` is further capped by
            ``note_tokens`` and by the room left in a token budget.
        answer_sampling: sampling of the answer call (default: ``sampling`` with
            ``answer_max_new_tokens``).
        answer_max_new_tokens: new-token limit of the answer call when ``answer_sampling`` is not given.
        note_tokens: most tokens one note may take.
        tokenizer: the tokenizer of the prompts when there is no backend (the oracle).
    """

    name = "notes"

    def __init__(self, backend: Any = None, sampling: Any = None, answer_sampling: Any = None,
                 answer_max_new_tokens: int = 32, note_tokens: int = 8, tokenizer: Any = None) -> None:
        super().__init__(backend, tokenizer)
        if not isinstance(note_tokens, int) or note_tokens < 1:
            raise ValueError(f"note_tokens must be an int >= 1, got {note_tokens!r}")
        self.note_tokens = note_tokens
        self.sampling = sampling if sampling is not None else default_sampling()
        self.answer_sampling = (answer_sampling if answer_sampling is not None
                                else replace(self.sampling, max_new_tokens=answer_max_new_tokens))
        self.prompts = PromptBuilder(self.tokenizer, NOTES_TEMPLATE)
        self.separator_ids = self.prompts.encode_text(SEPARATOR)

    def note_room(self, state: EpisodeState, info: dict[str, Any]) -> int:
        """Tokens the next note may take: ``note_tokens``, less when a token budget is nearly full
        (then the env never has to cut the memory, and the ids stay exactly what was sampled)."""
        if info.get("budget_unit") != "tokens" or info.get("memory_budget") is None:
            return self.note_tokens
        used = len(state.memory_ids) + (len(self.separator_ids) if state.memory_ids else 0)
        return min(self.note_tokens, int(info["memory_budget"]) - used)

    def appended(self, state: EpisodeState, note: list[int]) -> list[int]:
        """The memory ids with ``note`` appended (an empty note leaves them as they are)."""
        if not note:
            return list(state.memory_ids)
        return list(state.memory_ids) + (self.separator_ids if state.memory_ids else []) + list(note)

    def step(self, state: EpisodeState, obs: str, info: dict[str, Any]):
        self.sync_memory(state, info)
        if state.prefix_ids is None:
            state.prefix_ids = self.prompts.prefix(info["question"])
        phase = info.get("phase")
        if phase == "memory":
            room = self.note_room(state, info)
            if room < 1:  # the notes fill the budget: keep them, make no call
                return self.decode(state.memory_ids)
            chunk = self.prompts.encode_text(info["chunk"])
            prompt = self.prompts.build("memory", state.prefix_ids, memory=state.memory_ids, chunk=chunk)
            inv = yield (self.request(state, prompt, "memory", chunk_index=int(info["chunk_index"])),
                         replace(self.sampling, max_new_tokens=min(room, self.sampling.max_new_tokens)))
            state.pending_memory = self.appended(state, strip_stop(inv))
            return self.decode(state.pending_memory)
        if phase == "answer":
            prompt = self.prompts.build("answer", state.prefix_ids, memory=state.memory_ids)
            inv = yield self.request(state, prompt, "answer"), self.answer_sampling
            return self.decode(strip_stop(inv)).strip()
        raise ValueError(f"NotesAgent got an observation in phase {phase!r}; expected 'memory' or 'answer' "
                         "(reset the env after an episode ends)")


class NotesOracle(NotesAgent):
    """Gold notes from the sample's supporting facts (no model): each note is the supporting facts
    first read in that chunk, the answer the first gold answer. Its records have the notes layout
    and the form of a model's (response = the note's ids + EOS, log-probs 0), so they are SFT data
    for a teacher or student of :class:`NotesAgent`:

        python -m memopd.eval --agent examples.notes_agent:NotesOracle --split train --episodes 1000
    """

    name = "notes-oracle"
    calls_model = False

    def __init__(self, tokenizer: Any = None, samples: Any = None, note_tokens: int = 8) -> None:
        if tokenizer is None or samples is None or not hasattr(samples, "index_of"):
            raise ValueError("NotesOracle needs tokenizer= and samples= (the env's sample source)")
        super().__init__(tokenizer=tokenizer, note_tokens=note_tokens)
        self.samples = samples
        self.eos_id = int(tokenizer.eos_token_id)

    def step(self, state: EpisodeState, obs: str, info: dict[str, Any]) -> str:
        self.sync_memory(state, info)
        if state.prefix_ids is None:
            sample = self.samples[self.samples.index_of(str(info["sample_id"]))]
            state.prefix_ids = self.prompts.prefix(info["question"])
            state.extra.update(facts=supporting_texts(sample), answer=str(sample.answers[0]), noted=set())
        if info.get("phase") == "memory":
            room = self.note_room(state, info)
            if room < 1:
                return self.decode(state.memory_ids)
            new = [f for f in state.extra["facts"] if f not in state.extra["noted"] and _reads(info["chunk"], f)]
            note = self._fit(new, room)
            state.extra["noted"].update(new)
            prompt = self.prompts.build("memory", state.prefix_ids, memory=state.memory_ids,
                                        chunk=self.prompts.encode_text(info["chunk"]))
            self._record(state, prompt, note, "memory", chunk_index=int(info["chunk_index"]))
            state.pending_memory = self.appended(state, note)
            return self.decode(state.pending_memory)
        answer = state.extra["answer"]
        self._record(state, self.prompts.build("answer", state.prefix_ids, memory=state.memory_ids),
                     self.prompts.encode_text(answer), "answer")
        return answer

    def _fit(self, facts: list[str], room: int) -> list[int]:
        """The ids of the most whole facts (from the first) that fit ``room`` tokens."""
        ids: list[int] = []
        for i in range(len(facts), 0, -1):
            ids = self.prompts.encode_text(" ".join(facts[:i]))
            if len(ids) <= room:
                return ids
        return []

    def _record(self, state: EpisodeState, prompt: Any, ids: list[int], role: str, **meta: Any) -> None:
        response = list(ids) + [self.eos_id]
        req = self.request(state, prompt, role, oracle=True, **meta)
        state.invocations.append(Invocation(
            prompt_ids=req.prompt_ids, response_ids=response, logprobs=[0.0] * len(response),
            position_ids=list(range(len(req.prompt_ids) + len(response))), prefix_len=req.prefix_len,
            role=role, turn=req.turn, policy_version=0, finish_reason="eos", sampling={},
            timing={"start": time.time(), "latency_s": 0.0}, response_text=self.decode(ids),
            spans=req.spans, meta=req.meta))


def _reads(chunk: str, fact: str) -> bool:
    """``fact`` occurs in ``chunk`` as whole words."""
    return re.search(r"(?<!\w)" + re.escape(fact) + r"(?!\w)", chunk) is not None
