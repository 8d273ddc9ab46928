"""Score a predictions file against a gold file.

    python -m memgym.score PRED.jsonl --gold GOLD.jsonl [--json] [--per-example OUT.jsonl] [--hotpot]

PRED lines: ``{"id": ..., "prediction": "..."}``; GOLD lines: ``{"id": ..., "answers": ["...", ...]}``
(other fields are ignored, so a memgym task data file can serve as the gold file). Ids may be
strings or integers and are compared as strings. Blank lines are skipped.

Every gold id is scored; a gold id with no prediction scores 0 on every metric. Problems are
reported on stderr as ``FILE:LINE: message``: malformed lines (bad JSON, a missing or mistyped
field), duplicate ids (the first occurrence is used), gold ids without a prediction, and
predictions whose id is not in the gold file (ignored).

Exit status:
  0  every gold id had exactly one well-formed prediction and both files were clean;
  1  problems were found and reported, and the score was computed anyway over every well-formed
     gold line (missing predictions count as 0);
  2  nothing could be scored: a file is missing or unreadable, the gold file has no well-formed
     line, or the command line is wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from memgym.cli import CLIError, run_main
from memgym.data import TaskDataError, decode_line
from memgym.scoring import aggregate, score_answer

EXIT_OK, EXIT_PROBLEMS, EXIT_FATAL = 0, 1, 2


@dataclass
class _Parsed:
    values: dict[str, Any] = field(default_factory=dict)  # id -> value, first occurrence wins
    lines: dict[str, int] = field(default_factory=dict)  # id -> line number
    problems: list[str] = field(default_factory=list)


def _check_gold(obj: dict) -> tuple[Any, str | None]:
    answers = obj.get("answers")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        return None, "field 'answers': must be a non-empty list of strings"
    return answers, None


def _check_pred(obj: dict) -> tuple[Any, str | None]:
    pred = obj.get("prediction")
    if not isinstance(pred, str):
        got = "missing" if "prediction" not in obj else f"a {type(pred).__name__}"
        return None, f"field 'prediction': must be a string, got {got}"
    return pred, None


def _read(path: Path, check: Callable[[dict], tuple[Any, str | None]]) -> _Parsed:
    out = _Parsed()
    with path.open("rb") as fh:
        for lineno, data in enumerate(fh, start=1):
            raw = decode_line(data, path, lineno)  # a binary file fails here, naming itself
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                out.problems.append(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(obj, dict):
                out.problems.append(f"{where}: expected a JSON object, got {type(obj).__name__}")
                continue
            sid = obj.get("id")
            if not isinstance(sid, (str, int)) or isinstance(sid, bool):
                got = "missing" if "id" not in obj else f"a {type(sid).__name__}"
                out.problems.append(f"{where}: field 'id': must be a string or integer, got {got}")
                continue
            sid = str(sid)
            value, error = check(obj)
            if error:
                out.problems.append(f"{where}: {error}")
                continue
            if sid in out.values:
                out.problems.append(f"{where}: duplicate id {sid!r} (first on line {out.lines[sid]}; that one is used)")
                continue
            out.values[sid], out.lines[sid] = value, lineno
    return out


def score_files(pred_path: str | Path, gold_path: str | Path, hotpot_rules: bool = False
                ) -> tuple[dict[str, float], list[dict[str, Any]], list[str]]:
    """Score a prediction file against a gold file.

    Returns ``(summary, per_example, problems)``: the aggregate ``{"n", "em", "f1", "sub_em"}``
    over every well-formed gold id, one record per gold id (in gold-file order), and the
    problem messages. Raises ``OSError`` for an unreadable file and :class:`TaskDataError` for a
    file that is not UTF-8 text, both naming the file.
    """
    pred_path, gold_path = Path(pred_path), Path(gold_path)
    gold = _read(gold_path, _check_gold)
    preds = _read(pred_path, _check_pred)
    problems = gold.problems + preds.problems
    per_example = []
    for sid, answers in gold.values.items():
        prediction = preds.values.get(sid)
        if prediction is None:
            problems.append(f"{gold_path}:{gold.lines[sid]}: id {sid!r} has no prediction in {pred_path} (scored 0)")
            metrics = {"em": 0.0, "f1": 0.0, "sub_em": 0.0}
        else:
            metrics = score_answer(prediction, answers, hotpot_rules=hotpot_rules)
        per_example.append({"id": sid, "prediction": prediction, "answers": answers,
                            "missing": prediction is None, **metrics})
    for sid, lineno in preds.lines.items():
        if sid not in gold.values:
            problems.append(f"{pred_path}:{lineno}: id {sid!r} is not in {gold_path} (ignored)")
    return aggregate(per_example), per_example, problems


def _table(summary: dict[str, float]) -> str:
    rows = [("n", str(summary["n"])), ("EM", f"{summary['em']:.4f}"),
            ("F1", f"{summary['f1']:.4f}"), ("sub-EM", f"{summary['sub_em']:.4f}")]
    return "\n".join(f"{name:<7} {value:>8}" for name, value in rows)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m memgym.score",
        description="Score predictions (EM, F1, sub-EM with SQuAD v1.1 normalisation) against gold answers.",
        epilog="exit status: 0 clean; 1 problems reported on stderr, score computed anyway "
               "(missing predictions score 0); 2 nothing could be scored.",
    )
    p.add_argument("pred", type=Path, help='predictions JSONL: {"id": ..., "prediction": "..."} per line')
    p.add_argument("--gold", type=Path, required=True, help='gold JSONL: {"id": ..., "answers": [...]} per line')
    p.add_argument("--json", action="store_true", help='print {"n", "em", "f1", "sub_em"} as JSON')
    p.add_argument("--per-example", type=Path, metavar="OUT.jsonl",
                   help="write one JSON line per gold id with its prediction and metrics")
    p.add_argument("--hotpot", action="store_true",
                   help="HotpotQA rule: a yes/no/noanswer mismatch scores F1 (and sub-EM) 0")
    return p


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Write ``records`` to ``path`` whole or not at all: a temporary file beside it, then a rename,
    so a full disk or a failed write leaves no half-written file. Errors name ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            for record in records:
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):  # there may be no temporary file (or no directory) to remove
            tmp.unlink()
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    for path in (args.pred, args.gold):
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "file not found"
            raise CLIError(f"{path}: {what}; check the path")
    summary, per_example, problems = score_files(args.pred, args.gold, hotpot_rules=args.hotpot)
    for message in problems:
        print(message, file=sys.stderr)
    if summary["n"] == 0:
        raise CLIError(f"{args.gold}: no well-formed gold lines; nothing to score (gold lines look like "
                       f'{{"id": "q1", "answers": ["Paris"]}})')
    if args.per_example:
        write_jsonl(args.per_example, per_example)
    if args.json:
        print(json.dumps({k: summary[k] for k in ("n", "em", "f1", "sub_em")}))
    else:
        print(_table(summary))
    if problems:
        print(f"{len(problems)} problem(s) reported above; exit status {EXIT_PROBLEMS}", file=sys.stderr)
        return EXIT_PROBLEMS
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; returns the exit status. Bad input prints ``error: ...`` on stderr and returns 2."""
    return run_main(lambda: _main(argv), errors=(TaskDataError,))


if __name__ == "__main__":
    sys.exit(main())
