"""The episode / run viewer without a browser: data extraction, escaping, CLI, terminal summary."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from pathlib import Path

import pytest

from agents.records import save_episodes
from memgym.scoring import score_answer
from memopd import view
from view_fixtures import SCRIPT_MEMORY, encode, make_episode, make_run_dir, sample_episodes, tiny_tokenizer

SCRIPT_TAG = re.compile(r'<script type="application/json" id="([\w-]+)">(.*?)</script>', re.S)


def embedded(html: str) -> dict[str, object]:
    """The JSON blocks of a report, by element id."""
    return {k: json.loads(v) for k, v in SCRIPT_TAG.findall(html)}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture()
def episodes_file(tmp_path, tok):
    path = tmp_path / "episodes.jsonl"
    save_episodes(path, sample_episodes(tok, 6))
    return path


def test_index_rows_match_the_records(episodes_file, tmp_path):
    out = tmp_path / "r.html"
    assert view.main([str(episodes_file), "-o", str(out)]) == 0
    data = embedded(out.read_text())
    eps = view.load_source(episodes_file).episodes
    rows = data["memopd-index"]["rows"]
    assert [r["id"] for r in rows] == [ep.episode_id for ep in eps]
    for r, ep in zip(rows, eps):
        assert r["calls"] == len(ep.invocations)
        assert r["ctx"] == max(len(i.prompt_ids) + len(i.response_ids) for i in ep.invocations)
        assert r["mem"] == max(len(i.response_ids) for i in ep.invocations if i.role == "memory")
        assert r["fail"] == (ep.metrics["f1"] < 1)
        kls = [v for i in ep.invocations for v in i.meta.get("teacher_kl", [])]
        assert r["kl"] == (pytest.approx(sum(kls) / len(kls)) if kls else None)
    assert sum(r["fail"] for r in rows) == 2  # episodes 0 and 3 answer with the wrong company
    # one lazily parsed block per episode; the index carries no invocation data
    assert sorted(k for k in data if k.startswith("ep-")) == sorted(f"ep-{i}" for i in range(len(eps)))
    assert all(not isinstance(v, (list, dict)) for r in rows for v in r.values())


def test_report_is_self_contained(episodes_file, tmp_path):
    html = (out := tmp_path / "r.html") and view.write_report(view.load_source(episodes_file), out).read_text()
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)
    assert "<link" not in html and "@import" not in html and "url(" not in html


def test_script_memory_is_escaped(episodes_file, tmp_path):
    html = view.write_report(view.load_source(episodes_file), tmp_path / "r.html").read_text()
    n = len(view.load_source(episodes_file).episodes)
    assert "window.__pwned" in SCRIPT_MEMORY and "<script>window.__pwned" not in html
    assert html.count("<script") == n + 2  # the index, one per episode, the code; nothing injected
    assert html.count("</script") == n + 2
    ep1 = embedded(html)["ep-1"]
    n_mem = len(encode(tiny_tokenizer(), SCRIPT_MEMORY))
    assert ep1["calls"][2]["segments"][0] == {"name": "memory", "tokens": n_mem, "text": SCRIPT_MEMORY,
                                              "source": "recorded"}
    assert ep1["calls"][1]["action"] == SCRIPT_MEMORY


@pytest.mark.parametrize("text", ["</script><script>alert(1)</script>", "<!-- <script>", "a & b > c",
                                  "line\u2028sep\u2029", 'quote " and \\ backslash', "東京 😀"])
def test_script_json_round_trips_without_markup(text):
    out = view.script_json({"t": text})
    assert "<" not in out and ">" not in out and "&" not in out
    assert json.loads(out) == {"t": text}


def test_token_pieces_rebuild_multibyte_text(tok):
    ids = encode(tok, "Ada works at Acme. café 東京 😀")
    # byte-level BPE splits these characters: decoded one token at a time they are broken
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = view.token_pieces(tok, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == "Ada works at Acme. café 東京 😀"
    assert pieces[:3] == [tok.decode([i]) for i in ids[:3]]


def test_cards_with_tokenizer_colour_every_action_token(tok):
    ep = sample_episodes(tok, 3)[2]
    d = view.episode_detail(ep, None, tok)
    prefix_len = ep.invocations[0].prefix_len
    assert d["prefix"] == {"tokens": prefix_len, "text": tok.decode(ep.invocations[0].prompt_ids[:prefix_len])}
    for card, inv in zip(d["calls"], ep.invocations):
        assert "".join(card["pieces"]) == inv.response_text
        assert card["kl"] == pytest.approx(inv.meta["teacher_kl"])
        assert card["kl_stats"]["max"] == pytest.approx(max(inv.meta["teacher_kl"]))
        assert card["logprobs"] == pytest.approx(inv.logprobs, abs=1e-4)
    assert d["kl_by_role"]["answer"]["n"] == len(ep.invocations[-1].response_ids)


def test_prompt_parts_from_recorded_spans(tok):
    ep = sample_episodes(tok, 3, record_texts=False)[1]
    plain = view.episode_detail(ep, None, None)
    assert plain["prefix"]["text"] is None
    for t, card in enumerate(plain["calls"]):
        names = [s["name"] for s in card["segments"]]
        assert names == (["memory", "chunk"] if t < 3 else ["memory"])
        # the memory received is the ids the previous call sampled
        assert card["segments"][0]["tokens"] == (len(ep.invocations[t - 1].response_ids) if t else 0)
        assert all(s["text"] is None for s in card["segments"]) and card["state"] is None
    assert plain["calls"][1]["pieces"] is None and plain["calls"][1]["kl"] is not None
    # with a tokenizer the spans are decoded: the memory is the previous action, the chunk its text
    decoded = view.episode_detail(ep, None, tok)
    seg = decoded["calls"][2]["segments"]
    assert [s["source"] for s in seg] == ["decoded", "decoded"]
    assert seg[0]["text"] == SCRIPT_MEMORY
    assert seg[1]["text"] == tok.decode(ep.invocations[2].prompt_ids[slice(*ep.invocations[2].spans["chunk"])])
    assert seg[1]["text"].startswith("Eun-ji works at") and decoded["calls"][2]["state"] is None


def test_prompt_parts_without_spans_or_texts(tok):
    ep = sample_episodes(tok, 3, record_texts=False, record_spans=False)[1]
    plain = view.episode_detail(ep, None, None)
    # memory received falls back on the previous memory write, as sampled
    assert plain["calls"][0]["segments"] == []
    assert plain["calls"][2]["segments"] == [{"name": "memory", "tokens": None, "text": SCRIPT_MEMORY,
                                              "source": "previous memory write, as sampled"}]
    # with a tokenizer the whole state after the prefix is decoded
    decoded = view.episode_detail(ep, None, tok)
    inv = ep.invocations[1]
    assert decoded["calls"][1]["state"] == tok.decode(inv.prompt_ids[inv.prefix_len:])
    assert decoded["calls"][1]["state"].startswith("Memory: Nothing relevant yet.\nChunk: ")


def test_malformed_spans_are_skipped(tok):
    inv = sample_episodes(tok, 1)[0].invocations[1]
    n = len(inv.prompt_ids)
    inv.spans = {"memory": [5, 2], "chunk": [0, n + 1], "context": "x", "other": [n - 3, n - 1]}
    assert view.prompt_spans(inv) == {"other": (n - 3, n - 1)}


def test_action_decoded_when_no_response_text(tok):
    ep = sample_episodes(tok, 1, kl=False)[0]
    ep.invocations[-1].response_text = ""
    assert view.episode_detail(ep, None, None)["calls"][-1]["action"] == ""
    card = view.episode_detail(ep, None, tok)["calls"][-1]
    assert card["action"] == ep.prediction and card["action_source"] == "decoded"


def test_score_breakdown_per_gold_answer(tok):
    ep = sample_episodes(tok, 1)[0]
    ep.prediction, ep.answers = "The Acme corp", ["Acme", "Acme Corporation", "Globex"]
    rows = view.score_breakdown(ep)
    # by hand: "acme corp" vs "acme": P 1/2, R 1, F1 2/3, contains it; vs "acme corporation":
    # P = R = 1/2, and "acme corp" is a substring of it; vs "globex": nothing shared
    assert [r["f1"] for r in rows] == pytest.approx([2 / 3, 0.5, 0.0])
    assert [r["em"] for r in rows] == [0.0, 0.0, 0.0] and [r["sub_em"] for r in rows] == [1.0, 1.0, 0.0]
    assert rows[0]["pred_norm"] == "acme corp" and rows[1]["gold_norm"] == "acme corporation"
    assert [r["common"] for r in rows] == [["acme"], ["acme"], []]
    best = score_answer(ep.prediction, ep.answers)
    assert max(r["f1"] for r in rows) == best["f1"] and max(r["sub_em"] for r in rows) == best["sub_em"]


def test_bad_teacher_kl_is_reported_not_fatal(tok, tmp_path):
    ep = sample_episodes(tok, 1)[0]
    ep.invocations[0].meta["teacher_kl"] = [0.1, 0.2]
    ep.invocations[1].meta["teacher_kl"] = ["high"] * len(ep.invocations[1].response_ids)
    ep.invocations[2].meta["teacher_kl"][0] = float("nan")
    d = view.episode_detail(ep, None, tok)
    assert d["calls"][0]["kl"] is None and "has 2 values for" in d["calls"][0]["warnings"][0]
    assert d["calls"][1]["kl"] is None and "not a number" in d["calls"][1]["warnings"][0]
    finite = ep.invocations[2].meta["teacher_kl"][1:]
    assert d["calls"][2]["kl"][0] is None
    assert d["calls"][2]["kl_stats"]["mean"] == pytest.approx(sum(finite) / len(finite))
    src = view.Source(tmp_path, "episodes", [ep], [None])
    assert embedded(view.render_html(src))["ep-0"]["calls"][2]["kl"][0] is None  # valid JSON, no NaN


def test_run_dir(tok, tmp_path):
    run = make_run_dir(tmp_path / "run", tok)
    src = view.load_source(run)
    assert src.kind == "run" and len(src.metrics) == 12 and src.metrics[0]["step"] == 1
    assert src.steps == [2] * 3 + [4] * 3 + [10] * 3  # step-10 after step-4, notes.txt ignored
    index = embedded(view.render_html(src))["memopd-index"]
    assert [(s["step"], s["n"]) for s in index["steps"]] == [(2, 3), (4, 3), (10, 3)]
    assert [p["keys"] for p in index["panels"]][1] == ["kl/all", "kl/memory", "kl/answer"]
    assert index["metrics"][-1]["kl/memory"] == pytest.approx(0.1)
    assert index["config"].endswith('name = "<b>run</b>"\n')
    assert [r["step"] for r in index["rows"]] == src.steps


def test_empty_sources(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    index = embedded(view.render_html(view.load_source(tmp_path / "empty.jsonl")))["memopd-index"]
    assert index["rows"] == [] and index["means"]["f1"] is None
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5, "entropy": NaN}\n{"step": 2, "rew')
    src = view.load_source(run)
    assert src.kind == "run" and src.episodes == []
    assert src.metrics == [{"step": 1, "reward": 0.5, "entropy": None}]  # cut last line dropped, NaN a gap
    assert view.main([str(run), "--text"]) == 0
    assert "0 episodes" in capsys.readouterr().out


def test_eval_dir_with_summary(episodes_file, tmp_path):
    d = tmp_path / "eval"
    d.mkdir()
    (d / "episodes.jsonl").write_text(episodes_file.read_text())
    (d / "summary.json").write_text(json.dumps({"f1": 0.5, "n": 6}))
    src = view.load_source(d)
    assert src.kind == "eval" and src.summary == {"f1": 0.5, "n": 6} and len(src.episodes) == 6
    (d / "summary.json").write_text("{not json")
    src = view.load_source(d)
    assert src.summary is None and "summary.json:1: invalid JSON" in src.errors[0]


def test_bad_lines_are_reported_and_skipped(episodes_file, tmp_path, capsys):
    lines = episodes_file.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], "{not json", lines[1][: len(lines[1]) // 2], lines[2]]) + "\n")
    out = tmp_path / "bad.html"
    assert view.main([str(bad), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{bad}:2:" in err and f"{bad}:3:" in err
    index = embedded(out.read_text())["memopd-index"]
    assert len(index["rows"]) == 2 and len(index["errors"]) == 2


def test_cli_errors(tmp_path, episodes_file, capsys):
    assert view.main([str(tmp_path / "missing.jsonl")]) == view.EXIT_ERROR
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert view.main([str(tmp_path / "empty")]) == view.EXIT_ERROR
    assert "holds no episodes.jsonl" in capsys.readouterr().err
    assert view.main([str(episodes_file), "--episode", "99"]) == view.EXIT_ERROR
    assert "no episode '99'" in capsys.readouterr().err
    assert view.main([str(episodes_file), "--tokenizer", str(tmp_path / "no-tokenizer")]) == view.EXIT_ERROR
    assert "could not load tokenizer" in capsys.readouterr().err


def test_default_output_and_options(episodes_file, tok, tmp_path):
    assert view.main([str(episodes_file), "--episode", "ep-00002", "--failures-only"]) == 0
    index = embedded(episodes_file.with_suffix(".html").read_text())["memopd-index"]
    assert index["options"]["open_episode"] == 2 and index["options"]["failures_only"] is True
    run = make_run_dir(tmp_path / "run", tok)
    assert view.main([str(run)]) == 0 and (run / "report.html").is_file()


def test_cli_tokenizer_directory(episodes_file, tok, tmp_path):
    tok.save_pretrained(tmp_path / "tok")
    out = tmp_path / "r.html"
    assert view.main([str(episodes_file), "-o", str(out), "--tokenizer", str(tmp_path / "tok")]) == 0
    data = embedded(out.read_text())
    assert data["memopd-index"]["tokenizer"] is True
    assert data["ep-0"]["prefix"]["text"].startswith("You read a long document")
    assert "".join(data["ep-2"]["calls"][2]["pieces"]).endswith("café 東京 😀")


def _console(terminal: bool):
    from rich.console import Console
    buf = io.StringIO()
    return Console(file=buf, width=140, force_terminal=terminal, color_system="standard" if terminal else None), buf


def test_text_summary(episodes_file, tok):
    src = view.load_source(episodes_file)
    console, buf = _console(terminal=False)
    view.print_text(src, console, episode="1", tokenizer=tok)
    out = buf.getvalue()
    assert "\x1b[" not in out  # not a terminal: no colour codes
    assert all(f"s{i}" in out for i in range(6))
    assert "episode 1: ep-00001" in out and out.count("turn ") >= 4
    assert "[bold]x[/bold]" in out  # episode text is printed, never read as rich markup
    console, buf = _console(terminal=True)
    view.print_text(src, console, failures_only=True, limit=1)
    out = buf.getvalue()
    assert "\x1b[" in out
    assert "1 more" in out and "episode 0: ep-00000" in out  # failures: episodes 0 and 3


def test_text_cli_writes_no_html_unless_asked(episodes_file, capsys):
    assert view.main([str(episodes_file), "--text", "--episode", "ep-00003"]) == 0
    assert "episode 3: ep-00003" in capsys.readouterr().out
    assert not episodes_file.with_suffix(".html").exists()


def test_many_episodes_stay_lazy(tok, tmp_path):
    base = make_episode(tok, 0, question="Where does Ada work?", answers=["Acme"], chunks=["Ada works at Acme."],
                        memories=["Ada works at Acme."], prediction="Acme")
    eps = [dataclasses.replace(base, episode_id=f"e{i}", sample_id=f"s{i}") for i in range(500)]
    html = view.render_html(view.Source(tmp_path, "episodes", eps, [None] * len(eps)))
    tags = SCRIPT_TAG.findall(html)
    assert len(tags) == 501
    index = json.loads(tags[0][1])
    assert len(index["rows"]) == 500 and index["options"]["page_size"] == view.PAGE_SIZE
    # the index stays small: the invocation data lives in the per-episode blocks
    assert len(tags[0][1]) < sum(len(v) for _, v in tags[1:]) / 4


# ----------------------------------------------------------------------------- failing like a tool


def fails(argv, capsys) -> str:
    """The CLI refuses: exit 2, one ``error:`` line on stderr, no traceback, no report."""
    assert view.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("name, content, says", [
    ("empty.jsonl", b"", "it is empty"),
    ("blank.jsonl", b"\n\n", "it is empty"),
    ("summary.json", b'{\n  "f1": 1.0,\n  "calls": 4\n}\n', "line(s) are not episode records"),
    ("other.jsonl", b'{"x": 1}\n{"y": 2}\n', "2 line(s) are not episode records, e.g. "),
    ("list.json", b"[1, 2, 3]\n", "an episode must be a JSON object"),
    ("data.bin", bytes(range(256)) * 40, "it is binary data, not JSONL text"),
    ("latin1.jsonl", "café\n".encode("latin-1") * 3, "it is binary data, not JSONL text"),
])
def test_sources_without_episodes_are_errors(tmp_path, capsys, name, content, says):
    path = tmp_path / name
    path.write_bytes(content)
    err = fails([str(path)], capsys)
    assert f"error: {path} holds no episodes: " in err and says in err and "episodes.jsonl" in err
    assert fails([str(path), "--text"], capsys) == err
    assert list(tmp_path.iterdir()) == [path]  # no report written


def test_directories_without_episodes_and_bad_options(tmp_path, episodes_file, capsys):
    run = tmp_path / "run"
    (run / "episodes").mkdir(parents=True)
    (run / "config.toml").write_text('model = "tiny"\n')
    assert "the run has logged no metrics and saved no episodes" in fails([str(run)], capsys)
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "episodes.jsonl").write_text("")
    assert f"{eval_dir} holds no episodes: it is empty" in fails([str(eval_dir)], capsys)
    assert "--limit must be >= 1" in fails([str(episodes_file), "--text", "--limit", "0"], capsys)
    assert "no episode '999': give an index 0..5" in fails([str(episodes_file), "--episode", "999"], capsys)
    err = fails([str(episodes_file), "-o", str(episodes_file / "r.html")], capsys)
    assert f"cannot write the report {episodes_file / 'r.html'}: a parent of it is a file" in err


def test_binary_lines_among_episodes_are_counted_not_listed(episodes_file, tmp_path, capsys):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(episodes_file.read_bytes() + (b"\xff\xfe\n" * 50))
    assert view.main([str(mixed), "-o", str(tmp_path / "r.html")]) == 0
    err = capsys.readouterr().err
    assert err.count("not UTF-8 text") == view.SHOWN_ERRORS and "and 45 more skipped lines" in err


def test_help_lists_the_whole_description_and_defaults_once(capsys):
    with pytest.raises(SystemExit):
        view.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "A source with no episodes" in text and "teacher KL" in text  # not only the first paragraph
    assert text.count("(default: 20)") == 1 and "(default: None)" not in text and "(default: False)" not in text


# ----------------------------------------------------------------------------- numbers, times, width


def test_whole_numbers_and_timestamps(tok, episodes_file, capsys):
    ep = sample_episodes(tok, 1)[0]
    ep.invocations[0].timing = {"start": 1796062579.06812, "end": 1796062579.5, "latency_s": 0.43, "tokens": 3.0,
                                "bad": float("nan")}
    card = view.episode_detail(ep, None)["calls"][0]
    assert card["timing"] == {"start": "2026-11-30 18:16:19 UTC", "end": "2026-11-30 18:16:19 UTC",
                              "latency_s": 0.43, "tokens": 3.0}
    assert view._num(3.0, 2) == "3" and view._num(0.5, 2) == "0.50" and view._num(12, 3) == "12"
    assert view.main([str(episodes_file), "--text", "--episode", "1"]) == 0
    out = capsys.readouterr().out
    assert "em=1  f1=1  sub_em=1" in out and "1.00" not in out and "1.000" not in out


def text_lines(argv, columns, monkeypatch, capsys) -> list[str]:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert view.main(argv) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("columns", [40, 60, 90, 200])
def test_text_fits_the_terminal_and_keeps_the_prediction(tok, tmp_path, monkeypatch, capsys, columns):
    eps = sample_episodes(tok, 4)
    for ep in eps:
        ep.task_id = "memgym/SomeRatherLongTaskName-v0"
        ep.answers = ["a rather long gold answer that takes room", *ep.answers]
    save_episodes(tmp_path / "e.jsonl", eps)
    lines = text_lines([str(tmp_path / "e.jsonl"), "--text"], columns, monkeypatch, capsys)
    assert max(len(line) for line in lines) <= columns
    head = next(k for k, line in enumerate(lines) if line.split()[:1] == ["#"])
    assert "prediction" in lines[head] and "F1" in lines[head]
    rows = lines[head + 2: head + 2 + len(eps)]
    for ep, row in zip(eps, rows):
        assert ep.prediction in row  # short predictions are never cut
    if columns >= 200:
        assert "gold" in lines[head] and "task" in lines[head] and "KL" in lines[head]


def test_fit_columns_truncates_before_dropping():
    cells = [{"#": "0", "task": "t" * 30, "sample": "s" * 20, "F1": "1", "calls": "4", "ctx": "143", "mem": "9",
              "KL": "0.500", "prediction": "p" * 30, "gold": "g" * 40}]
    wide = view.fit_columns(cells, 300, has_kl=True)
    assert wide["task"] == 30 and wide["gold"] == 40 and wide["prediction"] == 30
    mid = view.fit_columns(cells, 100, has_kl=True)
    assert set(mid) == set(view.INDEX_COLUMNS) and mid["prediction"] == 30 and mid["gold"] < 40
    narrow = view.fit_columns(cells, 40, has_kl=True)
    assert "gold" not in narrow and narrow["prediction"] >= view.PREDICTION_MIN
    assert sum(narrow.values()) + 3 * len(narrow) + 1 <= 40
    assert "KL" not in view.fit_columns(cells, 300, has_kl=False)


# ----------------------------------------------------------------------------- training runs


def trainer_run(tmp_path, tok, final_model: bool) -> Path:
    """A run directory as memopd.train writes it: zero-padded step files whose invocations carry
    the teacher's per-token KL (None where the teacher does not supervise), a config.toml naming
    the base model, and, once training ends, the final model in model/."""
    run = tmp_path / "run"
    (run / "episodes").mkdir(parents=True)
    tok.save_pretrained(tmp_path / "base")
    (run / "config.toml").write_text(f'env = "memgym/LongQA-v0"\nmodel = "{tmp_path / "base"}"\nsteps = 2\n')
    (run / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5, "kl/all": 0.9}\n')
    eps = sample_episodes(tok, 2)
    for ep in eps:
        for inv in ep.invocations:
            inv.meta["teacher_kl"][-1] = None  # the stop token, unsupervised
    save_episodes(run / "episodes" / "step-000001.jsonl", eps)
    if final_model:
        tok.save_pretrained(run / "model")
        (tmp_path / "base" / "tokenizer.json").unlink()  # only model/ can be read now
    return run


@pytest.mark.parametrize("final_model", [False, True])
def test_run_dir_kl_heatmap_uses_the_runs_tokenizer(tok, tmp_path, capsys, final_model):
    run = trainer_run(tmp_path, tok, final_model)
    for source in (run, run / "episodes" / "step-000001.jsonl"):
        out = tmp_path / "r.html"
        assert view.main([str(source), "-o", str(out)]) == 0
        assert "decoding with the run's tokenizer" in capsys.readouterr().err
        data = embedded(out.read_text())
        assert data["memopd-index"]["tokenizer"] is True and data["memopd-index"]["kl_scale"] > 0
        ep = view.load_source(source).episodes[0]
        for card, inv in zip(data["ep-0"]["calls"], ep.invocations):
            assert "".join(card["pieces"]) == inv.response_text  # one coloured piece per token
            assert len(card["kl"]) == len(inv.response_ids) and card["kl"][-1] is None
            assert card["kl"][0] == pytest.approx(inv.meta["teacher_kl"][0])


def test_run_tokenizer_that_cannot_load_is_a_warning(tok, tmp_path, capsys):
    run = trainer_run(tmp_path, tok, final_model=False)
    (run / "config.toml").write_text('model = "./no/such/model"\n')
    assert view.main([str(run), "-o", str(tmp_path / "r.html")]) == 0
    assert "warning: could not load tokenizer './no/such/model'" in capsys.readouterr().err
    assert embedded((tmp_path / "r.html").read_text())["memopd-index"]["tokenizer"] is False


def test_a_runs_headline_is_its_held_out_f1(tok, tmp_path, capsys):
    """A training run's report leads with the held-out F1 before and after (summary.json), not the
    mean of its training samples, which mixes every step's policy."""
    run = make_run_dir(tmp_path / "run", tok)
    (run / "config.toml").write_text("eval_episodes = 64\n")
    (run / "summary.json").write_text(json.dumps({"eval_before": {"f1": 0.03125}, "eval_after": {"f1": 1.0},
                                                  "steps": 10}))
    src = view.load_source(run)
    index = embedded(view.render_html(src))["memopd-index"]
    assert index["heldout"] == "held-out F1 0.031 -> 1.000 (64 test episodes)"
    assert view.main([str(run), "--text"]) == 0
    head = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal's width
    assert "held-out F1 0.031 -> 1.000 (64 test episodes)" in head
    assert "training samples of the logged steps" in head and "mean F1 over every step's samples" in head
