"""Representative text of the memory tasks, for the digit presets' tokenizer.

Its own module: it imports every memory task, and each task imports
:mod:`memgym.generators.memory_tasks` (kept there, it would be an import cycle)."""

from __future__ import annotations

from typing import Iterator

from memgym.chunking import iter_chunks
from memgym.generators import counting, knowledge_update, multi_value, variable_tracking


def tokenizer_corpus(n_samples: int = 400, seed: int = 0) -> Iterator[str]:
    """Representative text of every memory task (questions, chunks, answers, oracle memories), for
    the digit presets' tokenizer (:func:`agents.presets.digit_corpus`)."""
    modules = (knowledge_update, multi_value, variable_tracking, counting)
    for module in modules:
        yield " ".join(getattr(module, "WORDS", ()))
    for i in range(n_samples):
        module = modules[i % len(modules)]
        source = module.make_source("corpus", seed, num_chunks=4, chunk_size=64, num_samples=n_samples,
                                    distractor_similarity=0.5)
        sample = source[i]
        yield sample.question
        memory = ""
        for chunk in iter_chunks(sample.documents, 64):
            yield chunk.text
            memory = " ".join(sample.oracle.update(memory, chunk.text))
            yield memory
        yield " ".join(sample.answers)
