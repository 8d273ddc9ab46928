"""The scorer CLI: formats, problem reports with file:line, exit codes, per-example output."""

import errno
import json
import os
import subprocess
import sys

import pytest

from memgym.score import EXIT_FATAL, EXIT_OK, EXIT_PROBLEMS, main
from memgym.scoring import score_answer


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def gold(tmp_path):
    return write_jsonl(tmp_path / "gold.jsonl", [
        {"id": "q1", "answers": ["Paris"]},
        {"id": "q2", "answers": ["the Eiffel Tower", "Eiffel"]},
        {"id": 3, "answers": ["yes"]},
    ])


def test_clean_run_json(tmp_path, gold, capsys):
    preds = [{"id": "q1", "prediction": "paris."}, {"id": "q2", "prediction": "Eiffel Tower in Paris"},
             {"id": "3", "prediction": "yes it is"}]
    pred = write_jsonl(tmp_path / "pred.jsonl", preds)
    assert main([str(pred), "--gold", str(gold), "--json"]) == EXIT_OK
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"n", "em", "f1", "sub_em"}
    golds = [["Paris"], ["the Eiffel Tower", "Eiffel"], ["yes"]]
    expected = [score_answer(p["prediction"], g) for p, g in zip(preds, golds)]
    assert out["n"] == 3
    for key in ("em", "f1", "sub_em"):
        assert out[key] == pytest.approx(sum(e[key] for e in expected) / 3)
        assert 0.0 <= out[key] <= 1.0


def test_hotpot_flag(tmp_path, gold, capsys):
    pred = write_jsonl(tmp_path / "pred.jsonl", [{"id": "q1", "prediction": "Paris"},
                                                 {"id": "q2", "prediction": "Eiffel"},
                                                 {"id": 3, "prediction": "yes it is"}])
    main([str(pred), "--gold", str(gold), "--json"])
    plain = json.loads(capsys.readouterr().out)
    main([str(pred), "--gold", str(gold), "--json", "--hotpot"])
    hotpot = json.loads(capsys.readouterr().out)
    assert plain["f1"] == pytest.approx((1 + 1 + 0.5) / 3)
    assert hotpot["f1"] == pytest.approx(2 / 3)


def test_problems_reported_with_lines_and_exit_1(tmp_path, gold, capsys):
    pred = write_jsonl(tmp_path / "pred.jsonl", [
        {"id": "q1", "prediction": "Paris"},          # line 1
        "{not json",                                   # line 2
        {"id": "q1", "prediction": "London"},         # line 3: duplicate, ignored
        {"id": "zzz", "prediction": "x"},              # line 4: not in gold
        {"id": "q2", "prediction": 5},                 # line 5: wrong type
        {"prediction": "no id"},                       # line 6
    ])
    per = tmp_path / "per.jsonl"
    assert main([str(pred), "--gold", str(gold), "--json", "--per-example", str(per)]) == EXIT_PROBLEMS
    captured = capsys.readouterr()
    out, err = json.loads(captured.out), captured.err
    assert f"{pred}:2: invalid JSON" in err
    assert f"{pred}:3: duplicate id 'q1' (first on line 1" in err
    assert f"{pred}:4: id 'zzz' is not in" in err
    assert f"{pred}:5: field 'prediction'" in err
    assert f"{pred}:6: field 'id'" in err
    assert f"{gold}:2: id 'q2' has no prediction" in err
    assert f"{gold}:3: id '3' has no prediction" in err
    # q1 correct (first occurrence kept), q2 and 3 missing -> 0.
    assert out == {"n": 3, "em": pytest.approx(1 / 3), "f1": pytest.approx(1 / 3), "sub_em": pytest.approx(1 / 3)}
    rows = [json.loads(line) for line in per.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in rows] == ["q1", "q2", "3"]
    assert rows[0]["prediction"] == "Paris" and rows[0]["em"] == 1.0 and not rows[0]["missing"]
    assert rows[1]["missing"] and rows[1]["prediction"] is None and rows[1]["f1"] == 0.0


def test_malformed_gold_lines(tmp_path, capsys):
    gold = write_jsonl(tmp_path / "gold.jsonl", [{"id": "a", "answers": ["x"]}, {"id": "b", "answers": "x"},
                                                 {"id": "a", "answers": ["y"]}])
    pred = write_jsonl(tmp_path / "pred.jsonl", [{"id": "a", "prediction": "x"}])
    assert main([str(pred), "--gold", str(gold), "--json"]) == EXIT_PROBLEMS
    captured = capsys.readouterr()
    assert f"{gold}:2: field 'answers'" in captured.err
    assert f"{gold}:3: duplicate id 'a'" in captured.err
    assert f"{pred}:1: id 'b'" not in captured.err  # b is dropped from gold, not reported as extra
    assert json.loads(captured.out) == {"n": 1, "em": 1.0, "f1": 1.0, "sub_em": 1.0}


def test_fatal_cases(tmp_path, capsys):
    empty_gold = write_jsonl(tmp_path / "gold.jsonl", ["", "[1, 2]"])
    pred = write_jsonl(tmp_path / "pred.jsonl", [{"id": "a", "prediction": "x"}])
    assert main([str(pred), "--gold", str(empty_gold)]) == EXIT_FATAL
    assert "no well-formed gold lines" in capsys.readouterr().err
    assert main([str(tmp_path / "nope.jsonl"), "--gold", str(empty_gold)]) == EXIT_FATAL
    assert "nope.jsonl: file not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([str(pred)])  # --gold is required
    assert exc.value.code == 2


def test_subprocess_table_unicode(tmp_path):
    gold = write_jsonl(tmp_path / "gold.jsonl", [{"id": "u", "answers": ["Café Müller"]},
                                                 {"id": "v", "answers": ["東京"]}])
    pred = write_jsonl(tmp_path / "pred.jsonl", [{"id": "u", "prediction": "the CAFÉ MÜLLER!"},
                                                 {"id": "v", "prediction": "大阪"}])
    res = subprocess.run([sys.executable, "-m", "memgym.score", str(pred), "--gold", str(gold)],
                         capture_output=True, text=True, encoding="utf-8")
    assert res.returncode == 0, res.stderr
    lines = dict(line.split() for line in res.stdout.strip().splitlines())
    assert lines == {"n": "2", "EM": "0.5000", "F1": "0.5000", "sub-EM": "0.5000"}
    assert res.stderr == ""


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "memgym.score", *argv], capture_output=True, text=True, timeout=60)


def test_a_binary_input_file_is_named_not_dumped(tmp_path, gold):
    pred = tmp_path / "pred.jsonl"
    pred.write_bytes(b'{"id": "q1", "prediction": "Paris"}\n\x89PNG\r\n\x1a\n\x00\xff\n')
    res = run_cli(str(pred), "--gold", str(gold))
    assert res.returncode == EXIT_FATAL and "Traceback" not in res.stderr
    assert res.stderr.startswith(f"error: {pred}:2: not UTF-8 text")


@pytest.mark.parametrize("where", ["missing dir", "parent is a file", "a directory"])
def test_an_unwritable_per_example_path_is_an_error_line_and_leaves_nothing(tmp_path, gold, where):
    pred = write_jsonl(tmp_path / "pred.jsonl", [{"id": "q1", "prediction": "Paris"}])
    out = {"missing dir": tmp_path / "nodir" / "per.jsonl", "parent is a file": pred / "per.jsonl",
           "a directory": tmp_path}[where]
    before = sorted(tmp_path.rglob("*"))
    res = run_cli(str(pred), "--gold", str(gold), "--per-example", str(out))
    assert res.returncode == EXIT_FATAL and "Traceback" not in res.stderr
    assert f"error: {out}: " in res.stderr
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write a read-only directory")
def test_a_read_only_per_example_directory(tmp_path, gold):
    pred = write_jsonl(tmp_path / "pred.jsonl", [{"id": "q1", "prediction": "Paris"}])
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        res = run_cli(str(pred), "--gold", str(gold), "--per-example", str(ro / "per.jsonl"))
    finally:
        ro.chmod(0o700)
    assert res.returncode == EXIT_FATAL and f"error: {ro / 'per.jsonl'}: Permission denied" in res.stderr
    assert list(ro.iterdir()) == []


def test_a_full_disk_leaves_no_half_written_file(tmp_path, gold, monkeypatch, capsys):
    pred = write_jsonl(tmp_path / "pred.jsonl", [{"id": "q1", "prediction": "Paris"}])
    per = tmp_path / "per.jsonl"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)  # the write got as far as the last step, then the disk was full
    assert main([str(pred), "--gold", str(gold), "--per-example", str(per)]) == EXIT_FATAL
    assert f"error: {per}: No space left on device; free some disk space" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gold.jsonl", "pred.jsonl"]
