"""See what the agent did: episodes and training runs as one self-contained HTML report, or a
terminal summary.

    python -m memopd.view EPISODES.jsonl|EVAL_DIR|RUN_DIR [-o report.html] [--text]
                          [--episode K] [--failures-only] [--tokenizer SPEC]

Sources:
  EPISODES.jsonl  episode records (:mod:`agents.records`), one per line;
  EVAL_DIR        an eval CLI output directory: ``episodes.jsonl`` (+ ``summary.json``);
  RUN_DIR         a training run (:mod:`memopd.runlog`): ``metrics.jsonl`` (curves),
                  ``episodes/step-N.jsonl`` (sample episodes per step), ``config.toml``.

The report is a single HTML file that opens from disk (no server, no network: its
Content-Security-Policy forbids every fetch). Data is embedded as JSON in
``<script type="application/json">`` tags: one small index (rendered page by page) and one tag
per episode, parsed only when that episode is expanded, so 10,000 episodes open quickly. All
episode text is put into the page with ``textContent``, never as markup, and ``<``, ``>`` and
``&`` inside the JSON are written as ``\\u003c``/``\\u003e``/``\\u0026`` so no episode text can
close the script tag.

What each invocation card shows, and where it comes from:
  prompt parts     the data slots after the shared prefix (memory received, chunk, context) with
                   their token counts, from the spans the agents record (``Invocation.spans``: slot ->
                   ``[start, end)`` in ``prompt_ids``); their text is ``meta["memory_text"]`` /
                   ``meta["chunk_text"]`` when recorded, else the span decoded with ``--tokenizer``,
                   else token counts only. Without spans or texts, the memory received is shown as
                   the previous memory write (the action as sampled, before any budget cut), and
                   with a tokenizer the whole prompt after the prefix is decoded;
  action           ``Invocation.response_text``, else the decoded ``response_ids`` (tokenizer);
  teacher KL       ``meta["teacher_kl"]`` (one value per response token) and
                   ``meta["teacher_mode"]``: each action token coloured by its KL with the value
                   on hover (per-token text needs ``--tokenizer``; without one a strip of cells,
                   one per token, carries the colours), and a per-turn KL summary.

An episode counts as a failure when its F1 (``metrics["f1"]``, else the reward) is below 1.
Whole numbers print as integers and timestamps (``timing.start``) as UTC date-times.

A training run's episodes (the run directory, or one of its ``episodes/step-N.jsonl``) are
decoded with the run's own tokenizer (its final ``model/``, else the base model named in its
``config.toml``) unless ``--tokenizer`` names another, so the teacher-KL heatmap shows tokens.
``--text`` fits the terminal's width: other columns are truncated, then dropped, before the
prediction is.

A run of several envs (``--env`` repeated) or of a routing table (``--teacher KEY=SPEC``) is split
by env and by route: the curves of each env's F1 and KL and each route's supervised share
(:func:`memopd.runlog.run_panels`), and the held-out line with each env's before and after.

A source with no episodes (an empty file, a file of other JSON, a binary file, a directory
without episodes) is an error, like a missing path or an unknown ``--episode``: the viewer
prints ``error: <what, where, how to fix>`` on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import codecs
import html
import json
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from agents.records import Episode, Invocation, load_episodes
from memgym.cli import describe, run_main
from memgym.scoring import METRICS, normalize_answer, score_answer
from memopd.runlog import read_metrics, run_panels

EXIT_OK, EXIT_ERROR = 0, 2
PAGE_SIZE = 100  # index rows per page in the HTML report
PREVIEW_CHARS = 120  # prediction / gold text kept in the index rows
_STEP_FILE = re.compile(r"^step-(\d+)\.jsonl$")
_KNOWN_META = ("memory_text", "chunk_text", "teacher_kl", "teacher_mode", "spans", "episode_id")


class ViewerError(Exception):
    """The viewer cannot do what was asked (missing path, unknown episode, bad tokenizer)."""


# ----------------------------------------------------------------------------- sources


@dataclass
class Source:
    """Everything one report shows, read from an episodes file, an eval dir or a run dir."""

    path: Path
    kind: str  # "episodes" | "eval" | "run"
    episodes: list[Episode] = field(default_factory=list)
    steps: list[int | None] = field(default_factory=list)  # logged step of each episode (run dirs)
    errors: list[str] = field(default_factory=list)  # "FILE:LINE: message", lines that were skipped
    metrics: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl rows
    summary: dict[str, Any] | None = None  # eval summary.json
    config_text: str | None = None  # run config.toml


def load_source(path: str | Path) -> Source:
    """Read an episodes JSONL file, an eval output directory or a training run directory."""
    path = Path(path)
    if path.is_file():
        src = Source(path, "episodes")
        _add_episodes(src, path, None)
        return src
    if not path.is_dir():
        raise ViewerError(f"{path} does not exist: give an episodes JSONL file, an eval output "
                          "directory or a training run directory")
    if (path / "metrics.jsonl").is_file() or (path / "episodes").is_dir():
        src = Source(path, "run", metrics=_clean_metrics(read_metrics(path)))
        for step, file in _step_files(path / "episodes"):
            _add_episodes(src, file, step)
        if (path / "config.toml").is_file():
            src.config_text = (path / "config.toml").read_text(encoding="utf-8")
        src.summary = _read_summary(path / "summary.json", src.errors)  # written when training ends
        return src
    if (path / "episodes.jsonl").is_file():
        src = Source(path, "eval")
        _add_episodes(src, path / "episodes.jsonl", None)
        src.summary = _read_summary(path / "summary.json", src.errors)
        return src
    raise ViewerError(f"{path} holds no episodes.jsonl (eval output) nor metrics.jsonl / "
                      "episodes/step-N.jsonl (training run): point the viewer at one of those")


def check_has_episodes(src: Source) -> None:
    """A source with nothing to show is an error that says why: an empty file, lines that are not
    episode records (another JSON, a binary file), or a directory without episodes. A training
    run that has logged metrics but no sample episodes yet still has its curves to show."""
    if src.episodes or (src.kind == "run" and src.metrics):
        return
    file = src.path if src.path.is_file() else src.path / "episodes.jsonl"
    if file.is_file() and looks_binary(file):
        why = "it is binary data, not JSONL text"
    elif src.errors:
        why = f"{len(src.errors)} line(s) are not episode records, e.g. {src.errors[0]}"
    elif src.kind == "run":
        why = "the run has logged no metrics and saved no episodes/step-N.jsonl yet"
    else:
        why = "it is empty"
    raise ViewerError(f"{src.path} holds no episodes: {why}. Give a JSONL file of episode records, one per "
                      "line (agents.records; an eval's episodes.jsonl, a training run's episodes/step-N.jsonl), "
                      "an eval output directory or a training run directory")


def looks_binary(file: Path, probe: int = 8192) -> bool:
    """Whether a file's first bytes hold a NUL or are not UTF-8 (JSONL is UTF-8 text)."""
    with file.open("rb") as fh:
        head = fh.read(probe)
    if b"\0" in head:
        return True
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
    except UnicodeDecodeError:
        return True
    return False


def _add_episodes(src: Source, file: Path, step: int | None) -> None:
    report = load_episodes(file)
    src.episodes.extend(report.episodes)
    src.steps.extend([step] * len(report.episodes))
    src.errors.extend(f"{file}:{line}: {msg}" for line, msg in report.errors)


def _step_files(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_FILE.match(p.name))]
    return sorted(found)  # numeric order: step-10 after step-2


def _read_summary(path: Path, errors: list[str]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        errors.append(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})")
        return None
    return data if isinstance(data, dict) else {"summary": data}


def _clean_metrics(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keep the numeric fields of each metrics row that has a step (non-finite -> gap)."""
    out = []
    for row in rows:
        if not _is_number(row.get("step")):
            continue
        out.append({k: _finite(v) for k, v in row.items() if _is_number(v) or v is None})
    return out


# ----------------------------------------------------------------------------- tokenizer


def load_tokenizer(spec: str) -> Any:
    """Load a tokenizer without its model: a model preset (``tiny``, ``smollm2``, ...), a tokenizer
    or model directory, a ``.gguf`` file or a training run directory, as
    :func:`agents.models.load_tokenizer` reads them."""
    path = Path(spec).expanduser()
    if (path.is_absolute() or spec.startswith((".", "~"))) and not path.exists():
        raise ViewerError(f"could not load tokenizer {spec!r}: no such directory or file")
    try:
        from agents.models import load_tokenizer as tokenizer_of

        return tokenizer_of(spec)
    except Exception as exc:  # any loader failure means the same thing to the user
        raise ViewerError(f"could not load tokenizer {spec!r}: {exc}") from exc


def run_tokenizer_spec(path: Path) -> str | None:
    """The tokenizer a training run's episodes were sampled with: the run's final ``model/``
    directory, else the base model its ``config.toml`` names. ``path`` is the run directory or
    one of its ``episodes/step-N.jsonl`` files; None when it is not part of a run."""
    run = path.parent.parent if path.is_file() and _STEP_FILE.match(path.name) else path
    if not (run / "config.toml").is_file():
        return None
    if any((run / "model" / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return str(run / "model")
    try:
        model = _tomllib().loads((run / "config.toml").read_text(encoding="utf-8")).get("model")
    except (OSError, UnicodeDecodeError, ValueError):  # TOMLDecodeError is a ValueError
        return None
    return model if isinstance(model, str) else None


def _tomllib() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str] | None:
    """The text each token adds, such that ``"".join(pieces) == decode(ids)``; None when the
    tokenizer's decoding cannot be split that way (then the caller shows whole text)."""
    ids = list(ids)
    full = decode(tokenizer, ids)
    pieces = [tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
              for i in ids]
    if "".join(pieces) == full:
        return pieces
    if len(ids) > 2048:  # the incremental split below is quadratic
        return None
    # Incremental decoding: a token that ends inside a multi-byte character adds "" and the
    # token completing the character carries it (byte-level BPE splits UTF-8 this way).
    pieces, prev = [], ""
    for k in range(1, len(ids) + 1):
        text = decode(tokenizer, ids[:k])
        if k < len(ids) and text.endswith("\ufffd"):
            pieces.append("")
            continue
        if not text.startswith(prev):
            return None
        pieces.append(text[len(prev):])
        prev = text
    return pieces if "".join(pieces) == full else None


# ----------------------------------------------------------------------------- episode data


def episode_f1(ep: Episode) -> float:
    value = ep.metrics.get("f1", ep.reward)
    return float(value) if _is_number(value) else 0.0


def is_failure(ep: Episode) -> bool:
    return episode_f1(ep) < 1.0


def teacher_kl(inv: Invocation) -> tuple[list[float | None] | None, str | None]:
    """The per-token KL list of an invocation (non-finite values -> None) and a warning when
    ``meta["teacher_kl"]`` is there but unusable."""
    kl = inv.teacher_kl
    if kl is None:
        return None, None
    if not isinstance(kl, list):
        return None, f"meta.teacher_kl is a {type(kl).__name__}, not a list of numbers; ignored"
    if len(kl) != len(inv.response_ids):
        return None, (f"meta.teacher_kl has {len(kl)} values for {len(inv.response_ids)} "
                      "response tokens; ignored")
    out = []
    for x in kl:
        if x is not None and (type(x) not in (float, int)):
            return None, f"meta.teacher_kl holds {x!r}, not a number; ignored"
        out.append(x if x is not None and math.isfinite(x) else None)
    return out, None


def kl_stats(values: Sequence[float | None]) -> dict[str, float | int] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"mean": sum(vals) / len(vals), "max": max(vals), "n": len(vals)}


def episode_row(ep: Episode, index: int, step: int | None,
                kl_values: Sequence[float] | None = None) -> dict[str, Any]:
    """One index row: what the table shows, sorts and searches. ``kl_values``: the episode's
    finite teacher KL values when already extracted."""
    kls = kl_values
    if kls is None:
        kls = [v for inv in ep.invocations for v in (teacher_kl(inv)[0] or []) if v is not None]
    mem_calls = [len(inv.response_ids) for inv in ep.invocations if inv.role == "memory"]
    return {
        "i": index,
        "id": ep.episode_id,
        "task": ep.task_id,
        "sample": ep.sample_id,
        "step": step,
        "f1": _finite(ep.metrics.get("f1")),
        "em": _finite(ep.metrics.get("em")),
        "reward": _finite(ep.reward),
        "calls": len(ep.invocations),
        "ctx": max((inv.total_len for inv in ep.invocations), default=0),
        "mem": max(mem_calls, default=0),
        "kl": sum(kls) / len(kls) if kls else None,
        "pred": ep.prediction[:PREVIEW_CHARS],
        "gold": " | ".join(ep.answers)[:PREVIEW_CHARS],
        "fail": is_failure(ep),
        # lower-cased text the search box matches
        "text": " ".join([ep.episode_id, ep.task_id, ep.sample_id, ep.question, ep.prediction,
                          *ep.answers, *(["perturbed"] + [p.kind for p in ep.perturbations]
                                         if ep.perturbations else [])]).lower(),
    }


def score_breakdown(ep: Episode) -> list[dict[str, Any]]:
    """The scorer's view of the answer: per gold answer, both normalised forms, EM / F1 / sub-EM
    and the tokens they share (SQuAD rules; the recorded metrics stay the reference)."""
    if not ep.answers or not all(isinstance(a, str) for a in ep.answers):
        return []
    pred_norm = normalize_answer(ep.prediction)
    rows = []
    for gold in ep.answers:
        gold_norm = normalize_answer(gold)
        scores = score_answer(ep.prediction, [gold])
        common = sorted(set(pred_norm.split()) & set(gold_norm.split()))
        rows.append({"gold": gold, "gold_norm": gold_norm, "pred_norm": pred_norm, "common": common,
                     **{m: scores[m] for m in METRICS}})
    return rows


def prompt_spans(inv: Invocation) -> dict[str, tuple[int, int]]:
    """The data-slot spans an agent recorded in ``Invocation.spans`` (slot -> ``[start, end)`` in
    ``prompt_ids``, as :class:`agents.prompts.Prompt` has them); malformed entries are skipped."""
    spans = inv.spans if inv.spans is not None else inv.meta.get("spans")
    out: dict[str, tuple[int, int]] = {}
    if isinstance(spans, dict):
        for name, se in spans.items():
            if (isinstance(se, (list, tuple)) and len(se) == 2 and all(type(x) is int for x in se)
                    and 0 <= se[0] <= se[1] <= len(inv.prompt_ids)):
                out[str(name)] = (se[0], se[1])
    return out


def prompt_segments(inv: Invocation, tokenizer: Any, prev_memory: str | None) -> list[dict[str, Any]]:
    """The data parts of the prompt after the shared prefix, in prompt order: name, token count
    (from the recorded spans) and text (recorded, else decoded from the span with a tokenizer)."""
    spans = prompt_spans(inv)
    texts = {"memory": inv.meta.get("memory_text"), "chunk": inv.meta.get("chunk_text")}
    names = sorted((n for n in spans if spans[n][0] >= inv.prefix_len), key=lambda n: spans[n])
    names += [n for n, t in texts.items() if isinstance(t, str) and n not in names]
    segments = []
    for name in names:
        seg: dict[str, Any] = {"name": name, "tokens": None, "text": None, "source": None}
        if name in spans:
            start, end = spans[name]
            seg["tokens"] = end - start
            if tokenizer is not None:
                seg["text"], seg["source"] = decode(tokenizer, inv.prompt_ids[start:end]), "decoded"
        if isinstance(texts.get(name), str):
            seg["text"], seg["source"] = texts[name], "recorded"
        segments.append(seg)
    if not any(s["name"] == "memory" for s in segments) and prev_memory is not None:
        segments.insert(0, {"name": "memory", "tokens": None, "text": prev_memory,
                            "source": "previous memory write, as sampled"})
    return segments


def invocation_card(inv: Invocation, tokenizer: Any, prev_memory: str | None) -> dict[str, Any]:
    """What one invocation card shows (prompt segments, action, counts, per-token KL)."""
    warnings = []
    card: dict[str, Any] = {
        "turn": inv.turn, "role": inv.role, "policy_version": inv.policy_version,
        "finish_reason": inv.finish_reason, "prompt_tokens": inv.prompt_len,
        "prefix_tokens": inv.prefix_len, "response_tokens": len(inv.response_ids),
        "logp_mean": sum(inv.logprobs) / len(inv.logprobs) if inv.logprobs else None,
        "segments": prompt_segments(inv, tokenizer, prev_memory), "state": None,
        "sampling": _short_json(inv.sampling, 200) if inv.sampling else None,
        "timing": timing_fields(inv.timing),
        "teacher_mode": None if inv.meta.get("teacher_mode") is None else str(inv.meta["teacher_mode"]),
    }
    if tokenizer is not None and not prompt_spans(inv) and not any(
            s["source"] == "recorded" for s in card["segments"]):
        card["state"] = decode(tokenizer, inv.prompt_ids[inv.prefix_len:])  # no parts known: all of it

    card["action"] = inv.response_text
    if not inv.response_text and tokenizer is not None:
        card["action"] = decode(tokenizer, inv.response_ids)
    card["action_source"] = "response_text" if inv.response_text else ("decoded" if tokenizer else None)

    kl, note = teacher_kl(inv)
    if note:
        warnings.append(note)
    card["kl"] = [None if v is None else round(v, 6) for v in kl] if kl else None
    card["kl_stats"] = kl_stats(kl) if kl else None
    card["pieces"] = token_pieces(tokenizer, inv.response_ids) if (kl and tokenizer is not None) else None
    card["logprobs"] = [round(v, 4) for v in inv.logprobs] if kl else None
    extra = {k: v for k, v in inv.meta.items() if k not in _KNOWN_META}
    card["meta"] = _short_json(extra) if extra else None
    card["warnings"] = warnings
    return card


def perturbation_line(p: Any) -> str:
    """One replaced memory (:class:`memgym.perturb.Perturbation`) as the viewer says it."""
    again = {True: "a supporting fact was read again after it", False: "no supporting fact was read again",
             None: "the sample names no supporting fact"}[p.reappears]
    before, after = p.original or "(empty)", p.replacement or "(empty)"
    return f"{p.kind} after chunk {p.after_chunk}: {before!r} -> {after!r} ({again})"


def episode_detail(ep: Episode, step: int | None, tokenizer: Any = None) -> dict[str, Any]:
    """Everything the expanded episode shows; built in Python, drawn lazily by the page."""
    invs = ep.invocations
    prefix_len = invs[0].prefix_len if invs else 0
    calls, prev_memory = [], None
    for inv in invs:
        calls.append(invocation_card(inv, tokenizer, prev_memory))
        if inv.role == "memory":
            prev_memory = calls[-1]["action"]
    by_role: dict[str, list[float]] = {}
    for c in calls:
        by_role.setdefault(c["role"], []).extend(v for v in c["kl"] or [] if v is not None)
    by_role = {role: v for role, v in by_role.items() if v}
    return {
        "i": None, "id": ep.episode_id, "task": ep.task_id, "sample": ep.sample_id, "step": step,
        "seed": ep.seed, "group": ep.group_id, "reward": _finite(ep.reward),
        "metrics": {k: _finite(v) for k, v in ep.metrics.items() if _is_number(v)},
        "question": ep.question, "answers": ep.answers, "prediction": ep.prediction,
        "breakdown": score_breakdown(ep),
        "prefix": {"tokens": prefix_len,
                   "text": decode(tokenizer, invs[0].prompt_ids[:prefix_len]) if (invs and tokenizer) else None},
        "calls": calls,
        "perturbations": [perturbation_line(p) for p in ep.perturbations or []],
        "kl_by_role": {role: kl_stats(v) for role, v in by_role.items()},
        "meta": _short_json(ep.meta) if ep.meta else None,
    }


# ----------------------------------------------------------------------------- HTML report


def report_data(src: Source, tokenizer: Any = None, failures_only: bool = False,
                open_episode: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The page's index data and the per-episode details (same order as ``src.episodes``)."""
    rows, details = [], []
    for i, (ep, step) in enumerate(zip(src.episodes, src.steps)):
        d = episode_detail(ep, step, tokenizer)
        d["i"] = i
        details.append(d)
        rows.append(episode_row(ep, i, step, [v for c in d["calls"] for v in c["kl"] or [] if v is not None]))
    all_kl = sorted(v for d in details for c in d["calls"] for v in (c["kl"] or []) if v is not None)
    scores = [ep.metrics for ep in src.episodes]
    means = {m: _mean([s.get(m) for s in scores]) for m in METRICS}
    steps = sorted({s for s in src.steps if s is not None})
    index = {
        "title": f"memopd view: {src.path.name}",
        "source": str(src.path), "kind": src.kind,
        "rows": rows,
        "means": means,
        "failures": sum(r["fail"] for r in rows),
        "steps": [{"step": s, "n": sum(1 for x in src.steps if x == s),
                   "f1": _mean([r["f1"] for r in rows if r["step"] == s])} for s in steps],
        "errors": src.errors,
        "metrics": src.metrics,
        "panels": [{"title": t, "keys": list(k)} for t, k in run_panels(src.metrics)],
        "summary": src.summary,
        "heldout": heldout_line(src),
        "config": src.config_text,
        "kl_scale": all_kl[int(0.95 * (len(all_kl) - 1))] if all_kl else None,
        "tokenizer": tokenizer is not None,
        "options": {"failures_only": failures_only, "open_episode": open_episode, "page_size": PAGE_SIZE},
    }
    if index["kl_scale"] is not None:
        index["kl_scale"] = max(index["kl_scale"], 1e-6)
    return index, details


def script_json(obj: Any) -> str:
    """JSON safe inside a <script> element: ``<``, ``>``, ``&`` become ``\\u003c`` etc., so no
    text can close the tag (``</script>``) or open a comment; JSON.parse restores them."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(src: Source, tokenizer: Any = None, failures_only: bool = False,
                open_episode: int | None = None) -> str:
    """The self-contained report as one HTML string."""
    index, details = report_data(src, tokenizer, failures_only, open_episode)
    assets = resources.files("memopd") / "view_assets"
    episodes = "\n".join(f'<script type="application/json" id="ep-{d["i"]}">{script_json(d)}</script>'
                         for d in details)
    parts = {
        "title": html.escape(index["title"]),
        "css": (assets / "report.css").read_text(encoding="utf-8"),
        "js": (assets / "report.js").read_text(encoding="utf-8"),
        "index": script_json(index),
        "episodes": episodes,
    }
    template = (assets / "report.html").read_text(encoding="utf-8")
    # one pass, so text substituted in is never scanned for further placeholders
    return re.sub(r"\{\{(\w+)\}\}", lambda m: parts[m.group(1)], template)


def write_report(src: Source, out: str | Path, **kwargs: Any) -> Path:
    """Write the report beside its final name, then rename it: a failed write (full disk) leaves
    no half report, and an existing one stays whole until the new one is complete."""
    out = Path(out)
    text = render_html(src, **kwargs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def default_output(path: Path) -> Path:
    return path / "report.html" if path.is_dir() else path.with_suffix(".html")


# ----------------------------------------------------------------------------- terminal summary


SHOWN_ERRORS = 5  # skipped lines named one by one; a binary file has thousands


def skipped_lines(errors: Sequence[str]) -> list[str]:
    """``skipped FILE:LINE: why`` for the first few bad lines, then how many more there are."""
    lines = [f"skipped {err}" for err in errors[:SHOWN_ERRORS]]
    if len(errors) > SHOWN_ERRORS:
        lines.append(f"... and {len(errors) - SHOWN_ERRORS} more skipped lines (the HTML report lists them)")
    return lines


def heldout_line(src: Source) -> str | None:
    """A training run's headline: its held-out F1 before and after training, from ``summary.json``
    (the mean of its training samples mixes every step's policy, and is not the result)."""
    if src.kind != "run" or not src.summary:
        return None
    before, after = src.summary.get("eval_before") or {}, src.summary.get("eval_after") or {}
    if not isinstance(after, dict) or "f1" not in after:
        return None
    start = f"{before['f1']:.3f} -> " if isinstance(before, dict) and "f1" in before else ""
    n = None
    try:
        n = _tomllib().loads(src.config_text or "").get("eval_episodes")
    except ValueError:  # TOMLDecodeError: a hand-edited config; the line goes without the count
        pass
    tags = [k[: -len("/f1")] for k in after if k.endswith("/f1")]  # a run of several envs: each env's too
    each = ", ".join(f"{t} " + (f"{before[t + '/f1']:.3f} -> " if isinstance(before, dict) and t + "/f1" in before
                                else "") + f"{after[t + '/f1']:.3f}" for t in tags)
    count = f" ({n} test episodes{' of each env' if tags else ''})" if isinstance(n, int) else ""
    return f"held-out F1 {start}{after['f1']:.3f}" + count + (f"; by env: {each}" if tags else "")


def find_episode(src: Source, key: str | int) -> int:
    """Position of an episode given its index in the source (``#`` column) or its episode_id."""
    if isinstance(key, int) or (isinstance(key, str) and key.lstrip("-").isdigit()):
        k = int(key)
        if 0 <= k < len(src.episodes):
            return k
    for i, ep in enumerate(src.episodes):
        if ep.episode_id == str(key):
            return i
    raise ViewerError(f"no episode {key!r}: give an index 0..{len(src.episodes) - 1} or an episode_id")


def print_text(src: Source, console: Any = None, episode: str | int | None = None,
               failures_only: bool = False, limit: int = 20, tokenizer: Any = None) -> None:
    """Print the index (first ``limit`` rows) and one episode's calls with rich."""
    from rich import box
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    # the terminal's width as the shell reports it (COLUMNS, else the tty); 80 when piped
    console = console or Console(width=shutil.get_terminal_size().columns)
    picked = [i for i, ep in enumerate(src.episodes) if not failures_only or is_failure(ep)]
    f1s = [episode_f1(ep) for ep in src.episodes]
    head = Text(f"{src.path} ({src.kind}): ", style="bold")
    held_out = heldout_line(src)
    if held_out:
        head.append(held_out + "; ")
    head.append(f"{len(src.episodes)} episodes" + (" (training samples of the logged steps)" if src.kind == "run" else ""))
    if f1s:
        what = "mean F1 over every step's samples" if src.kind == "run" else "mean F1"
        head.append(f", {what} {sum(f1s) / len(f1s):.3f}, {sum(f < 1 for f in f1s)} failures (F1 < 1)")
    console.print(head)
    for line in skipped_lines(src.errors):
        console.print(Text(line, style="yellow"))
    if src.metrics:
        last = src.metrics[-1]
        keys = [k for _, ks in run_panels(src.metrics) for k in ks if last.get(k) is not None]
        console.print(Text(f"last logged step {last['step']}: " + ", ".join(f"{k}={last[k]:.4g}" for k in keys)))

    rows = [(i, episode_row(src.episodes[i], i, src.steps[i])) for i in picked[:limit]]
    table = index_table(rows, console.width, Table, Text, box)
    table.title = "failures" if failures_only else "episodes"
    console.print(table)
    if len(picked) > limit:
        console.print(Text(f"... {len(picked) - limit} more (the HTML report lists them all)", style="dim"))
    if not picked:
        console.print(Text("no failures" if failures_only and src.episodes else "no episodes"))
        return
    k = find_episode(src, episode) if episode is not None else picked[0]
    _print_episode(console, src.episodes[k], k, tokenizer, Panel, Text)


INDEX_COLUMNS = ("#", "task", "sample", "F1", "calls", "ctx", "mem", "KL", "prediction", "gold")
NUMERIC_COLUMNS = ("#", "F1", "calls", "ctx", "mem", "KL")
SHRINK = {"gold": 6, "task": 6, "sample": 6}  # truncated (with an ellipsis) first, to this width
DROP = ("gold", "KL", "mem", "ctx", "calls", "task", "sample")  # then dropped, in this order
PREDICTION_MIN = len("prediction")  # the prediction keeps at least its header's width (or all of it)
COLUMN_CAPTIONS = {"ctx": "ctx: peak context tokens of a call", "mem": "mem: largest memory written (tokens)",
                   "KL": "KL: mean teacher KL"}


def index_cells(i: int, r: dict[str, Any]) -> dict[str, str]:
    """The text of one index row, by column."""
    return {"#": str(i), "task": r["task"], "sample": r["sample"], "F1": _num(episode_f1_of_row(r), 2),
            "calls": str(r["calls"]), "ctx": str(r["ctx"]), "mem": str(r["mem"]),
            "KL": "" if r["kl"] is None else _num(r["kl"], 3), "prediction": r["pred"], "gold": r["gold"]}


def fit_columns(cells: Sequence[dict[str, str]], width: int, has_kl: bool) -> dict[str, int]:
    """Column widths that fit ``width`` terminal columns and keep the prediction: other text
    columns are truncated first, then whole columns dropped (gold, KL, counts, task, sample)."""
    cols = [c for c in INDEX_COLUMNS if has_kl or c != "KL"]
    widths = {c: max([len(c)] + [len(row[c]) for row in cells]) for c in cols}
    pred_min = min(widths["prediction"], PREDICTION_MIN)

    def room() -> int:  # what is left for the prediction (each column takes 3 more, the table 1)
        return width - 1 - 3 * len(widths) - sum(w for c, w in widths.items() if c != "prediction")

    for col, least in SHRINK.items():
        if room() < widths["prediction"]:
            widths[col] = max(least, min(widths[col], widths[col] - (widths["prediction"] - room())))
    for col in DROP:
        if room() >= pred_min:
            break
        widths.pop(col, None)
    widths["prediction"] = max(1, min(widths["prediction"], room()))
    return widths


def index_table(rows: Sequence[tuple[int, dict[str, Any]]], width: int, Table: Any, Text: Any, box: Any) -> Any:
    """The episode index as a rich table no wider than ``width``."""
    cells = [index_cells(i, r) for i, r in rows]
    widths = fit_columns(cells, width, has_kl=any(r["kl"] is not None for _, r in rows))
    captions = [text for col, text in COLUMN_CAPTIONS.items() if col in widths]
    table = Table(title_justify="left", box=box.SIMPLE_HEAD, caption="; ".join(captions) or None,
                  caption_justify="left")
    for col, w in widths.items():
        table.add_column(col, justify="right" if col in NUMERIC_COLUMNS else "left", no_wrap=True,
                         overflow="ellipsis", width=w)
    for (i, r), row in zip(rows, cells):
        f1 = episode_f1_of_row(r)
        table.add_row(*[Text(row[col], style=("green" if f1 >= 1 else "yellow" if f1 > 0 else "red")
                             if col == "F1" else "") for col in widths])
    return table


def episode_f1_of_row(r: dict[str, Any]) -> float:
    value = r["f1"] if r["f1"] is not None else r["reward"]
    return float(value) if _is_number(value) else 0.0


def _print_episode(console: Any, ep: Episode, k: int, tokenizer: Any, Panel: Any, Text: Any) -> None:
    d = episode_detail(ep, None, tokenizer)
    console.print(Text(f"\nepisode {k}: {ep.episode_id}  task {ep.task_id}  sample {ep.sample_id}", style="bold"))
    console.print(Text(f"question:   {ep.question}"))
    console.print(Text(f"gold:       {' | '.join(ep.answers)}"))
    console.print(Text(f"prediction: {ep.prediction}"))
    scores = [f"{m}={_num(v, 3)}" for m, v in d["metrics"].items() if v is not None]
    console.print(Text("scores:     " + "  ".join(scores)))
    for line in d["perturbations"]:
        console.print(Text(f"memory perturbed: {line}", style="yellow"))
    for c in d["calls"]:
        body = Text()
        for seg in c["segments"]:
            body.append(f"{seg['name']}: ", style="bold cyan")
            if seg["text"] is not None:
                body.append(_clip(seg["text"]) or "(empty)")
            else:
                body.append(f"({seg['tokens']} tokens; pass --tokenizer to decode)", style="dim")
            body.append("\n")
        if c["state"] is not None:
            body.append("state:  ", style="bold cyan")
            body.append(_clip(c["state"]) + "\n")
        body.append("action: ", style="bold magenta")
        if c["pieces"] and c["kl"]:
            scale = max((v for v in c["kl"] if v is not None), default=1.0) or 1.0
            for piece, v in zip(c["pieces"], c["kl"]):
                body.append(piece, style=_kl_style(v, scale))
        else:
            body.append(c["action"] or ("(empty)" if not c["response_tokens"] else
                                        f"({c['response_tokens']} tokens, no text recorded)"))
        for w in c["warnings"]:
            body.append(f"\nwarning: {w}", style="yellow")
        title = (f"turn {c['turn']} {c['role']} · prompt {c['prompt_tokens']} (prefix {c['prefix_tokens']})"
                 f" + response {c['response_tokens']} tok")
        if c["kl_stats"]:
            title += f" · KL mean {c['kl_stats']['mean']:.3f} max {c['kl_stats']['max']:.3f}"
        console.print(Panel(body, title=Text(title), title_align="left"))


def _kl_style(v: float | None, scale: float) -> str:
    if v is None:
        return ""
    x = min(1.0, v / scale)
    return "on red" if x > 0.66 else ("on dark_orange3" if x > 0.33 else "")


def _clip(text: str, n: int = 400) -> str:
    return text if len(text) <= n else text[:n] + f" ... ({len(text) - n} more chars)"


# ----------------------------------------------------------------------------- small helpers


def _num(v: float | int, digits: int) -> str:
    """A number as people read it: whole numbers as integers (``3``, not ``3.0``), others with
    ``digits`` decimals."""
    return str(int(v)) if float(v).is_integer() else f"{v:.{digits}f}"


TIME_KEY = re.compile(r"(^|_)(start|end|time|timestamp|at|started|finished)$")
EPOCH_RANGE = (1e9, 1e10)  # seconds since 1970: 2001 .. 2286; smaller values are durations


def timing_fields(timing: dict[str, Any]) -> dict[str, float | int | str]:
    """An invocation's timing for display: points in time (``start``, ``end``, ``*_time``) as
    UTC date-times, durations as numbers; non-numbers and non-finite values left out."""
    out: dict[str, float | int | str] = {}
    for key, v in timing.items():
        if not _is_number(v) or not math.isfinite(v):
            continue
        is_time = TIME_KEY.search(str(key)) and EPOCH_RANGE[0] <= v < EPOCH_RANGE[1]
        out[key] = format_time(v) if is_time else v
    return out


def format_time(seconds: float) -> str:
    """``1796062579.07`` -> ``2026-11-30 18:16:19 UTC``."""
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v: Any) -> float | int | None:
    return v if _is_number(v) and math.isfinite(v) else None


def _mean(values: Sequence[Any]) -> float | None:
    vals = [float(v) for v in values if _is_number(v) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def _short_json(obj: Any, n: int = 2000) -> str:
    text = json.dumps(obj, ensure_ascii=False, default=str)
    return text if len(text) <= n else text[:n] + " ..."


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from memopd.eval import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m memopd.view", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("source", help="episodes JSONL file, eval output directory or training run directory")
    p.add_argument("-o", "--output", help="HTML report to write (default: SOURCE.html beside a file, "
                   "DIR/report.html for a directory; with --text, only when given)")
    p.add_argument("--text", action="store_true", help="print a terminal summary (index + one episode's calls), "
                   "as wide as the terminal")
    p.add_argument("--episode", help="episode to show (index in the source or episode_id): printed with "
                   "--text, opened in the HTML report")
    p.add_argument("--failures-only", action="store_true", help="list only failures (F1 < 1)")
    p.add_argument("--tokenizer", help="tokenizer to decode prompts and split actions into tokens: a model "
                   "preset (tiny, smollm2, ...), a tokenizer or model directory, a .gguf file (default: a "
                   "training run's own tokenizer; otherwise recorded texts and token counts are shown)")
    p.add_argument("--limit", type=int, default=20, help="index rows printed with --text")
    return p.parse_args(argv)


def pick_tokenizer(spec: str | None, src: Source) -> Any:
    """``--tokenizer``, else a training run's own tokenizer (so its KL heatmap shows the tokens),
    else None. The run's tokenizer is a convenience: when it cannot be loaded, say so and go on."""
    if spec:
        return load_tokenizer(spec)
    run_spec = run_tokenizer_spec(src.path)
    if run_spec is None:
        return None
    try:
        tokenizer = load_tokenizer(run_spec)
    except ViewerError as exc:
        print(f"warning: {exc}; showing token counts (pass --tokenizer to decode)", file=sys.stderr)
        return None
    print(f"decoding with the run's tokenizer ({run_spec}); pass --tokenizer to choose another", file=sys.stderr)
    return tokenizer


def view(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise ViewerError(f"--limit must be >= 1 (index rows printed with --text), got {args.limit}")
    src = load_source(args.source)
    check_has_episodes(src)
    open_k = find_episode(src, args.episode) if args.episode is not None else None
    tokenizer = pick_tokenizer(args.tokenizer, src)
    for line in skipped_lines(src.errors):
        print(f"warning: {line}", file=sys.stderr)
    if args.text:
        print_text(src, episode=open_k, failures_only=args.failures_only, limit=args.limit, tokenizer=tokenizer)
    if args.output or not args.text:
        out = Path(args.output) if args.output else default_output(src.path)
        try:
            write_report(src, out, tokenizer=tokenizer, failures_only=args.failures_only, open_episode=open_k)
        except (FileExistsError, NotADirectoryError):
            raise ViewerError(f"cannot write the report {out}: a parent of it is a file, not a directory; "
                              "choose another place with -o") from None
        except OSError as exc:
            raise ViewerError(f"cannot write the report {out}: {describe(exc)} "
                              "(choose another place with -o)") from None
        print(f"wrote {out} ({len(src.episodes)} episodes)", file=sys.stderr)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: 0 on success; a source it cannot show prints ``error: ...`` and returns 2."""
    args = parse_args(argv)
    return run_main(lambda: view(args), errors=(ViewerError,))


if __name__ == "__main__":
    sys.exit(main())
