"""The sample schema every task produces, and strict loading of task data files.

A sample is one question over a long input made of documents:

    {"id": str, "question": str, "answers": [str, ...],
     "documents": [{"title": str, "text": str}, ...],
     "supporting_facts"?: [...], "metadata"?: {...}}

Generated tasks may hand out ``documents`` lazily (any iterable), so that an episode of
millions of tokens is streamed instead of held in memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator


class TaskDataError(ValueError):
    """A task data file is malformed; the message names the file, the line and the field."""


@dataclass(frozen=True)
class Document:
    title: str
    text: str


@dataclass
class Sample:
    """One question over a long input.

    ``documents`` is any iterable of :class:`Document`; generators may make it lazy.
    Iterating it twice must give the same documents (use a re-iterable, not a one-shot
    generator, when the episode may be re-read).
    """

    id: str
    question: str
    answers: list[str]
    documents: Iterable[Document]
    supporting_facts: list[Any] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    oracle: Any = None
    """How a scripted oracle solves this sample from its own memory
    (:class:`memgym.oracle.OracleScript`); ``None``: from ``supporting_facts``
    (:class:`memgym.oracle.FactsScript`)."""

    def iter_documents(self) -> Iterator[Document]:
        return iter(self.documents)


def _field_error(path: str | Path, line: int, fieldname: str, msg: str) -> TaskDataError:
    return TaskDataError(f"{path}:{line}: field '{fieldname}': {msg}")


def sample_from_dict(obj: Any, path: str | Path = "<data>", line: int = 0) -> Sample:
    """Validate one decoded JSON object against the schema and build a :class:`Sample`."""
    if not isinstance(obj, dict):
        raise TaskDataError(f"{path}:{line}: expected a JSON object, got {type(obj).__name__}")
    for name in ("id", "question", "answers", "documents"):
        if name not in obj:
            raise _field_error(path, line, name, "missing (required: id, question, answers, documents)")
    sid = obj["id"]
    if not isinstance(sid, (str, int)) or isinstance(sid, bool):
        raise _field_error(path, line, "id", f"must be a string, got {type(sid).__name__}")
    if not isinstance(obj["question"], str) or not obj["question"].strip():
        raise _field_error(path, line, "question", "must be a non-empty string")
    answers = obj["answers"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise _field_error(path, line, "answers", "must be a non-empty list of strings")
    docs_raw = obj["documents"]
    if not isinstance(docs_raw, list):
        raise _field_error(path, line, "documents", "must be a list of {title, text} objects")
    docs = []
    for i, d in enumerate(docs_raw):
        if not isinstance(d, dict) or not isinstance(d.get("text"), str):
            raise _field_error(path, line, f"documents[{i}].text", "each document needs a string 'text'")
        title = d.get("title", "")
        if not isinstance(title, str):
            raise _field_error(path, line, f"documents[{i}].title", "must be a string")
        docs.append(Document(title=title, text=d["text"]))
    sf = obj.get("supporting_facts", [])
    if not isinstance(sf, list):
        raise _field_error(path, line, "supporting_facts", "must be a list when given")
    meta = obj.get("metadata", {})
    if not isinstance(meta, dict):
        raise _field_error(path, line, "metadata", "must be an object when given")
    return Sample(id=str(sid), question=obj["question"], answers=list(answers), documents=docs,
                  supporting_facts=sf, metadata=meta)


def sample_to_dict(sample: Sample) -> dict[str, Any]:
    return {
        "id": sample.id,
        "question": sample.question,
        "answers": list(sample.answers),
        "documents": [{"title": d.title, "text": d.text} for d in sample.iter_documents()],
        "supporting_facts": sample.supporting_facts,
        "metadata": sample.metadata,
    }


def decode_line(data: bytes, path: str | Path, lineno: int) -> str:
    """One line of a JSONL file as text; raises :class:`TaskDataError` naming the file and line
    when it is not UTF-8 (a binary file, or another encoding)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskDataError(f"{path}:{lineno}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at column "
                            f"{exc.start + 1}); expected UTF-8 JSONL, one JSON object per line") from None


def load_jsonl_samples(path: str | Path) -> list[Sample]:
    """Load and validate a task's JSONL file; raises :class:`TaskDataError` naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise TaskDataError(f"{path}: data file not found")
    samples, seen = [], {}
    with path.open("rb") as fh:
        for lineno, data in enumerate(fh, start=1):
            raw = decode_line(data, path, lineno)
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise TaskDataError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            sample = sample_from_dict(obj, path, lineno)
            if sample.id in seen:
                raise _field_error(path, lineno, "id", f"duplicate id {sample.id!r} (first on line {seen[sample.id]})")
            seen[sample.id] = lineno
            samples.append(sample)
    if not samples:
        raise TaskDataError(f"{path}: no samples (the file is empty)")
    return samples
