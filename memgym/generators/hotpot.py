"""HotpotQA (distractor setting) and a RULER-style long variant, as memgym sample sources.

Data come from the Hugging Face hub through ``datasets.load_dataset`` (default
``hotpotqa/hotpot_qa``, config ``distractor``) or from local files given with ``path=``:

- a HotpotQA JSON file in the original format (a list of ``{"_id", "question", "answer",
  "supporting_facts": [[title, sent_id], ...], "context": [[title, [sentence, ...]], ...]}``),
  e.g. ``hotpot_dev_distractor_v1.json``;
- JSON lines or parquet files in the hub format (``"id"``, ``"context": {"title": [...],
  "sentences": [[...], ...]}``, ``"supporting_facts": {"title": [...], "sent_id": [...]}``);
- JSON lines already in the memgym schema (``{"id", "question", "answers", "documents", ...}``);
- a directory holding such files: the file for a split is picked by name (see
  :func:`split_files`), so a snapshot of the hub repository or the original HotpotQA download
  directory both work. A single file serves every split.

The hub has ``train`` and ``validation`` splits (HotpotQA's test set has no answers), so the
memgym split ``"test"`` reads ``validation``.

Each HotpotQA paragraph becomes a document (title + sentences joined by single spaces); the
supporting facts are kept as ``{"title", "sent_id", "text"}`` (``text`` is None for the few
HotpotQA facts whose sentence index is out of range).

The long variant (``target_length=...``, RULER's HotpotQA task): the sample's own paragraphs
(gold and, by default, its own distractors) plus paragraphs drawn at random from *other*
samples, one per drawn sample and never repeating a title, until adding the next one would pass
``target_length`` units (document titles and texts, in words or tokenizer tokens); then all
documents are shuffled, so the gold paragraphs land anywhere. Sample ``i`` depends only on
``(seed, split, i)`` and the data.
"""

from __future__ import annotations

import json
import random
import re
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from memgym.chunking import Counter, WordCounter, make_counter
from memgym.data import Document, Sample, TaskDataError, sample_from_dict

HUB_ID = "hotpotqa/hotpot_qa"
CONFIG = "distractor"
SPLITS = {"train": "train", "test": "validation", "validation": "validation", "dev": "validation"}
FILE_SUFFIXES = (".json", ".jsonl", ".parquet")
_KNOWN_CONFIGS = ("distractor", "fullwiki")
# Filename words that pick a split's file in a directory, in order of preference.
_SPLIT_NAMES = {"train": (("train",),), "validation": (("validation", "valid", "val", "dev"),),
                "test": (("test",), ("validation", "valid", "val", "dev"))}


class DatasetUnavailableError(RuntimeError):
    """The dataset could not be loaded from the hub; the message says how to use local files."""


@dataclass(frozen=True)
class _Loc:
    """Where a row came from, for error messages."""

    name: str
    pos: int
    is_line: bool  # pos is a 1-based line number, else a 0-based row index

    def __str__(self) -> str:
        return f"{self.name}:{self.pos}" if self.is_line else f"{self.name} [row {self.pos}]"


class _Rows:
    """Raw rows from one or more parts (Python lists or `datasets.Dataset`s), indexed globally."""

    def __init__(self, parts: Sequence[tuple[Sequence[Any], str, Sequence[int] | None]]):
        self.parts = [p for p in parts if len(p[0])]
        self.starts, total = [], 0
        for rows, _, _ in self.parts:
            self.starts.append(total)
            total += len(rows)
        self.total = total

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index: int) -> tuple[Any, _Loc]:
        k = bisect_right(self.starts, index) - 1
        rows, name, lines = self.parts[k]
        local = index - self.starts[k]
        loc = _Loc(name, lines[local], True) if lines is not None else _Loc(name, local, False)
        return rows[local], loc

    def ids(self) -> Iterator[tuple[Any, int]]:
        """``(raw id, global index)`` for every row, reading only the id column where possible."""
        for (rows, _, _), start in zip(self.parts, self.starts):
            columns = getattr(rows, "column_names", None)
            if columns is not None:  # a datasets.Dataset: read the column, not every row
                key = "_id" if "_id" in columns else "id"
                values = rows[key] if key in columns else [None] * len(rows)
            else:
                values = [r.get("_id", r.get("id")) if isinstance(r, dict) else None for r in rows]
            for offset, value in enumerate(values):
                yield value, start + offset


# --- raw row -> Sample --------------------------------------------------------------------------
def _err(loc: _Loc, fieldname: str, msg: str) -> TaskDataError:
    return TaskDataError(f"{loc}: field '{fieldname}': {msg}")


def _paragraphs(raw: dict, loc: _Loc) -> list[tuple[str, list[str]]]:
    context = raw.get("context")
    if isinstance(context, dict):  # hub format: {"title": [...], "sentences": [[...], ...]}
        titles, sentences = context.get("title"), context.get("sentences")
        if not isinstance(titles, list) or not isinstance(sentences, list) or len(titles) != len(sentences):
            raise _err(loc, "context", "expected {'title': [...], 'sentences': [[...], ...]} of equal lengths")
        pairs = list(zip(titles, sentences))
    elif isinstance(context, list):  # original format: [[title, [sentence, ...]], ...]
        if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in context):
            raise _err(loc, "context", "expected a list of [title, [sentence, ...]] pairs")
        pairs = [tuple(p) for p in context]
    else:
        raise _err(loc, "context", "missing or not a HotpotQA context (a list of [title, sentences] "
                                   "pairs, or the hub's {'title', 'sentences'} object)")
    for i, (title, sents) in enumerate(pairs):
        if not isinstance(title, str) or not isinstance(sents, list) or not all(isinstance(s, str) for s in sents):
            raise _err(loc, f"context[{i}]", "needs a string title and a list of string sentences")
    return [(t, list(s)) for t, s in pairs]


def _supporting(raw: dict, loc: _Loc) -> list[tuple[str, int]]:
    sf = raw.get("supporting_facts", [])
    if isinstance(sf, dict):
        titles, ids = sf.get("title", []), sf.get("sent_id", [])
        pairs = list(zip(titles, ids)) if isinstance(titles, list) and isinstance(ids, list) and len(titles) == len(ids) else None
    elif isinstance(sf, list) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in sf):
        pairs = [tuple(p) for p in sf]
    else:
        pairs = None
    if pairs is None or not all(isinstance(t, str) and isinstance(k, int) for t, k in pairs):
        raise _err(loc, "supporting_facts", "expected [[title, sent_id], ...] or {'title': [...], 'sent_id': [...]}")
    return pairs


def _hotpot_sample(raw: dict, loc: _Loc) -> Sample:
    sid = raw.get("_id", raw.get("id"))
    if not isinstance(sid, (str, int)) or isinstance(sid, bool):
        raise _err(loc, "_id", "missing or not a string (HotpotQA rows carry '_id' or 'id')")
    question = raw.get("question")
    if not isinstance(question, str) or not question.strip():
        raise _err(loc, "question", "must be a non-empty string")
    answer = raw.get("answer")
    if not isinstance(answer, str):
        raise _err(loc, "answer", "missing or not a string (HotpotQA's test files carry no answers: "
                                  "use the train or dev/validation data)")
    paragraphs = _paragraphs(raw, loc)
    sentences = {title: sents for title, sents in paragraphs}
    facts = []
    for title, k in _supporting(raw, loc):
        sents = sentences.get(title, [])
        text = sents[k].strip() if 0 <= k < len(sents) else None
        facts.append({"title": title, "sent_id": k, "text": text})
    documents = [Document(title, " ".join(s.strip() for s in sents if s.strip())) for title, sents in paragraphs]
    metadata = {"dataset": "hotpotqa", "gold_titles": list(dict.fromkeys(f["title"] for f in facts))}
    for key in ("type", "level"):
        if isinstance(raw.get(key), str):
            metadata[key] = raw[key]
    return Sample(id=str(sid), question=question, answers=[answer], documents=documents,
                  supporting_facts=facts, metadata=metadata)


def row_to_sample(raw: Any, loc: _Loc) -> Sample:
    """Convert one raw row (original HotpotQA, hub format or memgym schema) to a Sample."""
    if not isinstance(raw, dict):
        raise TaskDataError(f"{loc}: expected a JSON object, got {type(raw).__name__}")
    if "documents" in raw:  # already in the memgym schema
        return sample_from_dict(raw, loc.name, loc.pos)
    return _hotpot_sample(raw, loc)


def gold_titles(sample: Sample) -> set[str]:
    """Titles of the sample's gold (supporting) documents; empty when unknown."""
    titles = sample.metadata.get("gold_titles")
    if isinstance(titles, list):
        return {t for t in titles if isinstance(t, str)}
    found = set()
    for fact in sample.supporting_facts:
        if isinstance(fact, dict) and isinstance(fact.get("title"), str):
            found.add(fact["title"])
        elif isinstance(fact, (list, tuple)) and fact and isinstance(fact[0], str):
            found.add(fact[0])
    return found


# --- loading ------------------------------------------------------------------------------------
def hub_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"HotpotQA: unknown split {split!r}; use one of {sorted(SPLITS)} "
                         f"('test' reads HotpotQA's labelled validation split)")
    return SPLITS[split]


def _name_words(path: Path, base: Path) -> list[str]:
    return re.split(r"[^a-z0-9]+", str(path.relative_to(base)).lower())


def split_files(path: str | Path, split: str, config: str | None = CONFIG) -> list[Path]:
    """The data files for ``split`` under ``path`` (a file, or a directory searched recursively).

    In a directory (or its ``<config>/`` subfolder when there is one), files ending in .json,
    .jsonl or .parquet are matched by the words of their relative path: ``train`` for the train
    split; ``test``, else ``validation``/``valid``/``val``/``dev`` for the test split. Files named
    after the other HotpotQA config (``fullwiki`` when ``config="distractor"``) are skipped.
    """
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise TaskDataError(f"{path}: no such file or directory (pass path= a HotpotQA data file or a directory of them)")
    base = path / config if config and (path / config).is_dir() else path
    files = sorted(p for p in base.rglob("*") if p.is_file() and p.name.endswith(FILE_SUFFIXES))
    others = {c for c in _KNOWN_CONFIGS if c != config}
    files = [f for f in files if not others & set(_name_words(f, base))]
    preferences = _SPLIT_NAMES["test" if split == "test" else hub_split(split)]
    for names in preferences:
        chosen = [f for f in files if set(names) & set(_name_words(f, base))]
        if chosen:
            return chosen
    listing = ", ".join(str(f.relative_to(base)) for f in files) or "none"
    wanted = ", else ".join("/".join(names) for names in preferences)
    raise TaskDataError(
        f"{base}: no data file for split {split!r} (looked for .json/.jsonl/.parquet files named with "
        f"{wanted}; found: {listing}). Rename the files, or pass path= a single file to use it for every split.")


def _read_json_file(path: Path) -> tuple[list[Any], list[int] | None]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:  # a binary file: name it and the line, not the codec
        lineno = data.count(b"\n", 0, exc.start) + 1
        raise TaskDataError(f"{path}:{lineno}: not UTF-8 text; expected HotpotQA JSON or JSONL") from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TaskDataError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        return rows, None
    rows, lines = [], []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            rows.append(json.loads(raw))
        except json.JSONDecodeError as exc:
            raise TaskDataError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno}); "
                                f"expected a JSON list or one JSON object per line") from None
        lines.append(lineno)
    return rows, lines


def _read_parquet_file(path: Path, cache_dir: str | None) -> Any:
    import datasets  # lazy: heavy import, only needed for parquet and the hub

    return datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=cache_dir)


def _load_local(path: str | Path | Mapping[str, str], split: str, config: str | None, cache_dir: str | None) -> _Rows:
    if isinstance(path, Mapping):
        if split not in path:
            raise TaskDataError(f"path= maps splits {sorted(path)} to files, but split {split!r} is not among them")
        files = split_files(path[split], split, config)
    else:
        files = split_files(path, split, config)
    parts = []
    for f in files:
        if f.suffix == ".parquet":
            parts.append((_read_parquet_file(f, cache_dir), str(f), None))
        else:
            rows, lines = _read_json_file(f)
            parts.append((rows, str(f), lines))
    rows = _Rows(parts)
    if not len(rows):
        raise TaskDataError(f"{', '.join(map(str, files))}: no samples (the file is empty)")
    return rows


def _load_hub(hub_id: str, config: str | None, split: str, cache_dir: str | None) -> _Rows:
    hf_split = hub_split(split)
    try:
        import datasets  # lazy: heavy import

        ds = datasets.load_dataset(hub_id, config, split=hf_split, cache_dir=cache_dir)
    except Exception as exc:  # network, auth, missing dataset: all end the same way for the user
        raise DatasetUnavailableError(
            f"could not load {hub_id!r} (config {config!r}, split {hf_split!r}) from the Hugging Face hub: "
            f"{type(exc).__name__}: {exc}\n"
            f"Without hub access, pass path= to local files: the original HotpotQA JSON "
            f"(e.g. hotpot_dev_distractor_v1.json, hotpot_train_v1.1.json), JSON lines or parquet files "
            f"in the hub format or the memgym schema, or a directory holding them (such as a download "
            f"of the hub repository with {config}/train-*.parquet and {config}/validation-*.parquet). "
            f"Example: gymnasium.make('memgym/HotpotQA-v0', path='data/hotpot_dev_distractor_v1.json'). "
            f"(With HF_HUB_OFFLINE=1, datasets reads its local cache and skips the network retries.)"
        ) from exc
    return _Rows([(ds, f"{hub_id}/{config}/{hf_split}", None)])


# --- sources ------------------------------------------------------------------------------------
class HotpotSource:
    """HotpotQA samples in the distractor setting (the sample's own 10 paragraphs, in order)."""

    def __init__(self, rows: _Rows):
        self._rows = rows
        self._index: dict[str, int] | None = None
        self[0]  # fail early on a file in the wrong format

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Sample:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self):
            raise IndexError(f"sample index {index!r} out of range: this source has {len(self)} samples (0..{len(self) - 1})")
        raw, loc = self._rows[index]
        return row_to_sample(raw, loc)

    def index_of(self, sample_id: str) -> int:
        if self._index is None:
            index: dict[str, int] = {}
            for raw_id, i in self._rows.ids():
                sid = str(raw_id) if raw_id is not None else self[i].id
                if sid in index:
                    raise TaskDataError(f"{self._rows[i][1]}: duplicate sample id {sid!r} "
                                        f"(also at {self._rows[index[sid]][1]})")
                index[sid] = i
            self._index = index
        try:
            return self._index[str(sample_id)]
        except KeyError:
            raise KeyError(f"no sample with id {sample_id!r} in this HotpotQA source ({len(self)} samples)") from None


def _random_order(rng: random.Random, n: int, exclude: int) -> Iterator[int]:
    """Every index in range(n) except ``exclude`` once, in random order, drawn lazily."""
    seen = {exclude}
    while len(seen) < n:
        if 2 * len(seen) > n:  # dense: shuffle what is left rather than rejection-sample
            rest = [j for j in range(n) if j not in seen]
            rng.shuffle(rest)
            yield from rest
            return
        j = rng.randrange(n)
        if j not in seen:
            seen.add(j)
            yield j


class LongHotpotSource:
    """RULER-style long HotpotQA: gold paragraphs among distractors from other samples.

    ``target_length`` is measured by ``counter`` over document titles and texts (headers,
    question and instructions excluded). The sample's own paragraphs always stay, even when
    they alone exceed the target.
    """

    def __init__(self, base: HotpotSource, seed: int, split: str, target_length: int,
                 counter: Counter | None = None, keep_own_distractors: bool = True):
        self.base, self.seed, self.split = base, seed, split
        self.target_length = target_length
        self.counter = counter or WordCounter()
        self.keep_own_distractors = keep_own_distractors

    def __len__(self) -> int:
        return len(self.base)

    def index_of(self, sample_id: str) -> int:
        return self.base.index_of(sample_id)

    def _length(self, doc: Document) -> int:
        return self.counter.count(f"{doc.title}\n{doc.text}")

    def _distractors(self, index: int, rng: random.Random, used: set[str], room: int) -> list[Document]:
        # Passes over the other samples in random order, one unused paragraph from each, until the
        # next paragraph would not fit or a whole pass adds nothing.
        out: list[Document] = []
        while True:
            added = False
            for j in _random_order(rng, len(self.base), index):
                candidates = [d for d in self.base[j].documents if d.title not in used]
                if not candidates:
                    continue
                doc = rng.choice(candidates)
                cost = self._length(doc)
                if cost > room:
                    return out
                out.append(doc)
                used.add(doc.title)
                room -= cost
                added = True
            if not added:
                return out

    def __getitem__(self, index: int) -> Sample:
        sample = self.base[index]
        rng = random.Random(f"memgym/RULERHotpotQA/{self.seed}/{self.split}/{index}")
        own = list(sample.documents)
        gold = gold_titles(sample) or {d.title for d in own}
        kept = own if self.keep_own_distractors else [d for d in own if d.title in gold]
        room = self.target_length - sum(self._length(d) for d in kept)
        documents = kept + self._distractors(index, rng, {d.title for d in own}, room)
        rng.shuffle(documents)
        metadata = dict(sample.metadata)
        metadata.update({
            "target_length": self.target_length,
            "length": sum(self._length(d) for d in documents),
            "length_unit": self.counter.unit,
            "num_documents": len(documents),
            "gold_positions": [k for k, d in enumerate(documents) if d.title in gold],
        })
        return Sample(id=sample.id, question=sample.question, answers=list(sample.answers), documents=documents,
                      supporting_facts=sample.supporting_facts, metadata=metadata)


def make_source(split: str = "train", seed: int = 0, path: str | Path | Mapping[str, str] | None = None,
                hub_id: str = HUB_ID, config: str | None = CONFIG, target_length: int | None = None,
                context_length: int | None = None, counter: Counter | None = None, tokenizer: Any = None,
                keep_own_distractors: bool = True, cache_dir: str | None = None) -> HotpotSource | LongHotpotSource:
    """HotpotQA samples for ``split``; with ``target_length`` the RULER-style long variant.

    Args:
        split: "train" or "test" ("test" reads HotpotQA's validation split; "validation"/"dev" too).
        seed: seeds the long variant's distractor draw and shuffling (unused otherwise).
        path: local data instead of the hub: a file, a directory, or a {split: file} mapping
            (see the module docstring and :func:`split_files`).
        hub_id, config: the hub dataset, used when ``path`` is None.
        target_length: total length of the long variant's documents, in ``counter`` units;
            None gives the plain distractor setting.
        context_length: the environment's name for ``target_length`` (either may be given).
        counter: measures units (the environment passes its own); default words, or tokens of
            ``tokenizer`` when that is given.
        keep_own_distractors: the long variant keeps the sample's own distractor paragraphs
            (as RULER does); False keeps only its gold paragraphs.
        cache_dir: ``datasets`` cache directory for hub and parquet data.
    """
    hub_split(split)
    if target_length is not None and context_length is not None and target_length != context_length:
        raise ValueError(f"HotpotQA: target_length={target_length} and context_length={context_length} "
                         f"disagree; give one of them")
    target = target_length if target_length is not None else context_length
    if target is not None and (not isinstance(target, int) or isinstance(target, bool) or target < 1):
        raise ValueError(f"HotpotQA: target_length must be a positive int or None, got {target!r}")
    if path is not None:
        rows = _load_local(path if isinstance(path, Mapping) else Path(path), split, config, cache_dir)
    else:
        rows = _load_hub(hub_id, config, split, cache_dir)
    base = HotpotSource(rows)
    if target is None:
        return base
    if counter is None:  # called on its own: words unless a tokenizer is named (an env passes its counter)
        counter = make_counter(tokenizer) if tokenizer is not None else WordCounter()
    return LongHotpotSource(base, seed, split, target, counter, keep_own_distractors)
