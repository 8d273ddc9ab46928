"""The length positive control and the memory-binds study: their pipelines on a tiny budget (slow),
and docs/RESULTS.md's tables rebuilt from the committed results JSON."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_length_control_smoke_and_rerun(tmp_path):
    lc = load("length_control")
    assert lc.main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["arms"] == ["before", "after"] and results["lengths"] == [6, 12]
    rows = {(r["arm"], r["agent"], r["chunks"]) for r in results["rows"]}
    assert rows == {(a, "memagent", 6) for a in ("before", "after")} | {
        (a, "rag-memagent", n) for a in ("before", "after") for n in (6, 12)}
    first = json.loads((tmp_path / "teacher-after" / "stage-0-3" / "sft_config.json").read_text())
    last = json.loads((tmp_path / "teacher-after" / "stage-1-6" / "sft_config.json").read_text())
    assert first["model"] == "tiny-teacher-digits" and first["env_kwargs"]["numbering"] == "random"
    assert last["model"] == str(tmp_path / "teacher-after" / "stage-0-3") and last["env_kwargs"]["num_chunks"] == 6
    cached = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert lc.main(["--smoke", "--out", str(tmp_path)]) == 0  # a rerun reuses every evaluation
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == cached
    assert "| before (tiny-teacher, sequential) |" in lc.table(results)


@pytest.mark.slow
def test_memory_binds_smoke(tmp_path):
    mb = load("memory_binds")
    assert mb.main(["--smoke", "--out", str(tmp_path), "--tasks", "MultiValue"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    oracle = {(r["task"], r["budget"]): r["oracle_f1"] for r in results["ladder"]}
    assert oracle[("MultiValue", 16)] == 1.0 and oracle[("MultiValue", 3)] == pytest.approx(2 / 3)  # 1 of 2 facts
    assert oracle[("LongQA", 3)] == 1.0 and oracle[("LongQA", 2)] == 0.0  # one fact of 3 tokens
    assert [(r["task"], r["budget"]) for r in results["teacher"]] == [("MultiValue", 16), ("MultiValue", 3)]
    assert [(r["task"], r["budget"]) for r in results["students"]] == [("MultiValue", 16), ("MultiValue", 3)]
    config = (tmp_path / "MultiValue-3" / "config.toml").read_text()
    assert 'model = "tiny-digits"' in config and "memory_budget = 3" in config
    for part, table in mb.TABLES.items():
        assert table(results[part]).count("\n") >= 2


@pytest.mark.slow
def test_long_horizon_smoke_and_rerun(tmp_path):
    """Every policy trains (or is built) and is read at both lengths; a rerun recomputes nothing."""
    lh = load("long_horizon")
    assert lh.main(["--smoke", "--out", str(tmp_path), "--tasks", "Counting"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    cells = {(r["policy"], r["seed"], r["num_chunks"]) for r in results["rows"]}
    far = lh.SMOKE["far"]  # past the ladder: the memory policies only, with their own drop
    assert cells == {(p, 0, n) for p in lh.POLICIES for n in (3, 6)} | {(p, 0, far) for p in lh.FAR_POLICIES}
    assert all(len(r["f1"]) == 4 for r in results["rows"])
    assert set(results["summary"]["Counting"]) == set(lh.POLICIES) and "Counting" in results["verdicts"]
    for policy, got in results["summary"]["Counting"].items():
        assert ("far_drop" in got) == (policy in lh.FAR_POLICIES)
        assert "drop" in got and set(got["by_length"]) == {"3", "6", *([str(far)] if policy in lh.FAR_POLICIES else [])}
    config = (tmp_path / "Counting" / "opd-persistent-s0" / "config.toml").read_text()
    assert 'teacher_context = "persistent"' in config and "num_chunks = 3" in config
    assert 'numbering = "random"' in config
    sft = json.loads((tmp_path / "Counting" / "sft-oracle-s0" / "sft_config.json").read_text())
    assert sft["steps"] == 4 and sft["model"] == "tiny-digits"  # the warm start's 2 steps + the RL arms' 2
    assert (tmp_path / "length.png").is_file()
    # a run with a checkpoint resumes; one killed before its first checkpoint (its config.toml written) starts over
    run = tmp_path / "Counting" / "ppo-s0"
    assert lh.rl_argv(run, ["--steps", "2"]) == ["--resume", str(run)]
    early = tmp_path / "early"
    early.mkdir()
    (early / "config.toml").write_text((run / "config.toml").read_text())
    assert lh.rl_argv(early, ["--steps", "2"]) == ["--steps", "2", "--run-dir", str(early)]
    rows = sorted((tmp_path / "rows").iterdir())
    stamps = [p.stat().st_mtime_ns for p in rows]
    assert lh.main(["--smoke", "--out", str(tmp_path), "--tasks", "Counting", "--cached-only"]) == 0
    assert [p.stat().st_mtime_ns for p in sorted((tmp_path / "rows").iterdir())] == stamps
    assert json.loads((tmp_path / "results.json").read_text())["summary"] == results["summary"]


def test_long_horizon_resumes_from_the_published_results(tmp_path, capsys):
    """A new checkout goes on where the published study stopped: --resume-from the committed JSON makes
    its cells the rows of an empty --out, and a cached-only publish from them rebuilds that JSON's
    summary, verdicts and rows exactly. A cell computed here is kept; other settings are refused."""
    lh = load("long_horizon")
    published = ROOT / "docs" / "data" / "long_horizon" / "results.json"
    committed = json.loads(published.read_text())
    out = tmp_path / "study"
    mine = {**committed["rows"][0], "mean_f1": -1.0}  # a cell this checkout computed itself
    name = f"{mine['task']}-{mine['policy']}-s{mine['seed']}-{mine['num_chunks']}.json"
    lh.write_row(out / "rows" / name, mine)
    task = "MultiValue"
    assert lh.main(["--out", str(out), "--tasks", task, "--cached-only", "--resume-from", str(published),
                    "--publish", str(tmp_path / "pub.json")]) == 0
    said = capsys.readouterr().out
    assert f"resumed {len(committed['rows']) - 1} finished cells of {len(committed['rows'])}" in said
    assert json.loads((out / "rows" / name).read_text())["mean_f1"] == -1.0
    rebuilt = json.loads((tmp_path / "pub.json").read_text())
    assert rebuilt["rows"] == [r for r in committed["rows"] if r["task"] == task]
    assert rebuilt["summary"][task] == committed["summary"][task]
    assert rebuilt["verdicts"][task] == committed["verdicts"][task]
    # computed with another recipe, another task option or by another script: one error line each
    for field, change in (("recipes", {"rl_steps": 80}), ("tasks", {"memory_budget": 8})):
        other = json.loads(published.read_text())
        other[field][task] = {**other[field][task], **change}
        path = tmp_path / f"other-{field}.json"
        path.write_text(json.dumps(other))
        with pytest.raises(SystemExit, match=r"^error: --resume-from .* was computed with another"):
            lh.main(["--out", str(tmp_path / "x"), "--cached-only", "--resume-from", str(path)])
    with pytest.raises(SystemExit, match=r"^error: --resume-from .* is not a results JSON of examples/long_horizon"):
        lh.main(["--out", str(tmp_path / "x"), "--cached-only", "--resume-from",
                 str(ROOT / "docs" / "data" / "aligned_vs_persistent" / "results.json")])
    assert not (tmp_path / "x" / "rows").exists()  # refused before anything was written


def test_aligned_vs_persistent_resumes_from_the_published_results(tmp_path):
    """Part 3 likewise: its published readings (teachers, runs and their 32L readings, shifts) become
    rows, and a cached-only publish rebuilds the committed JSON without building a teacher or a run."""
    avp = load("aligned_vs_persistent")
    published = ROOT / "docs" / "data" / "aligned_vs_persistent" / "results.json"
    committed = json.loads(published.read_text())
    flags = committed["command"].split()[2:]  # the published cells' own selection (lengths, seeds)
    assert avp.main(["--out", str(tmp_path), *flags, "--cached-only", "--resume-from", str(published),
                     "--publish", str(tmp_path / "pub.json")]) == 0
    rebuilt = json.loads((tmp_path / "pub.json").read_text())
    for key in ("teacher_f1", "unfair", "summary", "verdicts", "runs", "shifts"):
        assert rebuilt[key] == committed[key], key
    assert not (tmp_path / "LongQA" / "aligned-vs-persistent" / "teachers").exists()


def test_smollm2_at_length_resumes_from_the_published_results(tmp_path):
    """Part 4 likewise: its published cells become rows, and a cached-only publish rebuilds the committed
    JSON without training or loading a model; cells read in another dtype are refused."""
    part4 = load("smollm2_at_length")
    published = ROOT / "docs" / "data" / "smollm2_at_length" / "results.json"
    committed = json.loads(published.read_text())
    assert part4.main(["--out", str(tmp_path), "--cached-only", "--resume-from", str(published),
                       "--publish", str(tmp_path / "pub.json")]) == 0
    rebuilt = json.loads((tmp_path / "pub.json").read_text())
    for key in ("summary", "verdicts", "rows"):
        assert rebuilt[key] == committed[key], key
    other = tmp_path / "bf16.json"
    other.write_text(json.dumps({**committed, "dtype": "bfloat16"}))
    with pytest.raises(SystemExit, match=r"^error: --resume-from .* was computed with another dtype"):
        part4.main(["--out", str(tmp_path / "x"), "--cached-only", "--resume-from", str(other)])


def test_long_horizon_pools_by_distance_only_the_lengths_every_seed_has():
    """One seed read at 1,000 chunks must not weigh that seed's long distances alone in the pooled fit."""
    lh = load("long_horizon")
    cells = [{"seed": s, "num_chunks": n} for s in (0, 1) for n in (6, 192)] + [{"seed": 0, "num_chunks": 1000}]
    assert lh.balanced(cells) == cells[:4]
    assert lh.balanced(cells[:4] + [{"seed": 1, "num_chunks": 1000}, cells[4]]) == cells[:4] + [
        {"seed": 1, "num_chunks": 1000}, cells[4]]


def test_long_horizon_drop_and_verdicts_by_hand():
    """The drop F1(32L) - F1(L) and its bootstrap bound on cells worked by hand: with every episode of
    a seed alike, resampling changes nothing and the bound is the drop itself."""
    lh = load("long_horizon")

    def cells(policy, f1_short, f1_long):
        return [{"task": "T", "policy": policy, "seed": s, "num_chunks": n, "f1": [v] * 8, "mean_f1": v}
                for s, (a, b) in enumerate(zip(f1_short, f1_long)) for n, v in ((6, a), (192, b))]

    flat = lh.drop_lower_bound(cells("memopd", [1.0, 0.8], [0.9, 0.7]), 6, 192)
    assert flat["drop"] == pytest.approx(-0.1) and flat["lower_95"] == pytest.approx(-0.1) and flat["seeds"] == 2
    spread = lh.drop_lower_bound(cells("memopd", [1.0, 1.0], [1.0, 0.0]), 6, 192)  # one seed kept, one lost
    assert spread["drop"] == pytest.approx(-0.5) and spread["lower_95"] == pytest.approx(-1.0)
    args = lh.parse_args(["--tasks", "LongQA", "--policies", "memopd,warm-start"])
    args.tasks = ["T"]
    rows = cells("memopd", [1.0, 1.0], [0.99, 0.98]) + cells("warm-start", [0.9, 0.9], [0.1, 0.2])
    said = lh.verdicts(lh.summarise(rows, args))
    assert said["T"].startswith("holds")
    rows = cells("memopd", [1.0, 1.0], [0.5, 0.5]) + cells("warm-start", [0.9, 0.9], [0.1, 0.2])
    assert lh.verdicts(lh.summarise(rows, args))["T"].startswith("does not hold")
    rows = cells("memopd", [1.0, 1.0], [1.0, 1.0]) + cells("warm-start", [0.9, 0.9], [0.9, 0.8])
    assert lh.verdicts(lh.summarise(rows, args))["T"].startswith("too easy")
    rows = cells("memopd", [1.0, 1.0], [1.0, 1.0]) + cells("warm-start", [0.03, 0.02], [0.0, 0.0])
    assert lh.verdicts(lh.summarise(rows, args))["T"].startswith("not tested: no contrast policy")


def test_long_horizon_fact_distance_by_replaying_the_env():
    """The chunks read after the fact, against a replay of the env that looks for the fact's text in
    each chunk it shows (not the sample's recorded chunk index the script reads)."""
    import gymnasium as gym

    import memgym  # noqa: F401

    lh = load("long_horizon")
    for task, n in (("LongQA", 24), ("KnowledgeUpdate", 12)):
        env = gym.make(f"memgym/{task}-v0", **{**lh.TASKS[task], "num_chunks": n}, split="test")
        ids, want = [], []
        for i in range(4):
            obs, info = env.reset(options={"index": i})
            sample = env.unwrapped.source[i]
            words = set(" ".join(sample.answers).split())
            texts = [f["text"] for f in sample.supporting_facts if words & set(f["text"].split())]
            first = None
            while info["phase"] == "memory":
                if first is None and any(t in info["chunk"] for t in texts):
                    first = info["chunk_index"]
                obs, _, _, _, info = env.step("")
            ids.append(sample.id)
            want.append(n - 1 - first)
        assert lh.fact_distances(task, n, ids) == want


def test_long_horizon_retention_fit_by_hand():
    """F1 = a * r**d recovered from its own points; a flat F1 keeps everything (r = 1, no half-life)."""
    lh = load("long_horizon")
    fit = lh.retention([(d, 0.8 * 0.9 ** d) for d in range(40)])
    assert fit["r"] == pytest.approx(0.9, abs=1e-4) and fit["a"] == pytest.approx(0.8, abs=1e-3)
    assert fit["half_life_chunks"] == pytest.approx(math.log(0.5) / math.log(0.9), rel=1e-3)
    flat = lh.retention([(d, 0.5) for d in (0, 3, 30, 300)])
    assert flat["r"] == 1.0 and flat["a"] == pytest.approx(0.5) and flat["half_life_chunks"] is None


def test_on_policy_premise_smoke_and_rerun(tmp_path):
    """The teacher and the imitation student are read clean and perturbed at L; a rerun recomputes nothing."""
    premise = load("on_policy_premise")
    assert premise.main(["--smoke", "--out", str(tmp_path), "--tasks", "KnowledgeUpdate"]) == 0
    results = json.loads((tmp_path / "premise.json").read_text())
    assert set(results["summary"]["KnowledgeUpdate"]) == {"teacher", "teacher-further", "teacher-recovering", "sft-oracle"}
    assert all(r["spec"] == "distractor@0" and len(r["f1"]) == 4 for r in results["rows"])
    data = (tmp_path / "KnowledgeUpdate" / "oracle-perturbed" / "episodes.jsonl").read_text()
    assert '"kind": "distractor"' in data  # the recovering teacher's oracle data has perturbed states
    clean = (tmp_path / "KnowledgeUpdate" / "oracle-clean" / "episodes.jsonl").read_text()
    assert clean and '"kind": "distractor"' not in clean  # the further teacher's data has none
    assert any(again is not None for r in results["rows"] for again in r["reappears"])  # the wrapper perturbed
    stamps = [p.stat().st_mtime_ns for p in sorted((tmp_path / "rows-premise").iterdir())]
    assert premise.main(["--smoke", "--out", str(tmp_path), "--tasks", "KnowledgeUpdate", "--cached-only"]) == 0
    assert [p.stat().st_mtime_ns for p in sorted((tmp_path / "rows-premise").iterdir())] == stamps


def test_on_policy_premise_pairs_and_verdicts_by_hand():
    """Episodes pair by sample; the loss where the fact is read again is the mean paired difference."""
    premise = load("on_policy_premise")
    clean = {"task": "LongQA", "f1": [1.0, 1.0, 0.0, 1.0], "sample_ids": ["a", "b", "c", "d"]}
    perturbed = {"sample_ids": ["b", "a", "c", "d"], "f1": [1.0, 0.0, 0.0, 1.0], "reappears": [True, True, False, None]}
    got = premise.paired(clean, perturbed)
    assert got["recovery"]["episodes"] == 2 and got["recovery"]["f1_clean"] == 1.0
    assert got["recovery"]["loss"] == pytest.approx(-0.5) and got["recovery"]["loss_se"] == pytest.approx(0.5)
    assert got["no_recovery"] == {"episodes": 1, "f1_clean": 0.0, "f1_perturbed": 0.0, "loss": 0.0, "loss_se": None}
    assert got["f1_clean_all"] == 0.75 and got["f1_perturbed_all"] == 0.5

    def summary(**losses):  # policy -> (clean F1, change where the fact is read again)
        return {"T": {p: {"f1_clean_all": clean, "recovery": {"loss": loss}} for p, (clean, loss) in losses.items()}}

    said = premise.verdicts(summary(**{"sft-oracle": (0.9, -0.5), "teacher-recovering": (0.8, -0.05)}))["T"]
    assert said == "shown: where it could recover, sft-oracle's F1 changes by -0.500, the recovering teacher's by -0.050"
    # the student never learned the clean task: the auto teacher, an imitation agent too, stands in
    said = premise.verdicts(summary(**{"sft-oracle": (0.03, 0.0), "teacher": (0.86, -0.33),
                                       "teacher-recovering": (0.8, 0.0)}))["T"]
    assert said.startswith("shown") and "teacher's F1 changes by -0.330" in said
    assert premise.verdicts(summary(**{"sft-oracle": (0.03, 0.0), "teacher-recovering": (0.8, 0.0)}))["T"] \
        .startswith("not tested yet: no imitation agent")
    assert premise.verdicts(summary(**{"teacher": (0.86, -0.33), "teacher-recovering": (0.0, 0.0)}))["T"] \
        .startswith("not tested yet: the recovering teacher")
    assert premise.verdicts(summary(**{"teacher": (0.86, -0.1), "teacher-recovering": (0.8, 0.0)}))["T"] \
        .startswith("not shown: where it could recover")
    # more imitation that recovers undoes the premise: the best-recovering imitator is the one read
    said = premise.verdicts(summary(**{"teacher": (0.86, -0.33), "teacher-further": (0.95, -0.02),
                                       "teacher-recovering": (0.97, 0.0)}))["T"]
    assert said == ("not shown: where it could recover, imitation's F1 changes by at most -0.020 (teacher-further; "
                    "it must lose 0.2)")
    assert premise.verdicts(summary(**{"teacher": (0.86, -0.33), "teacher-recovering": (0.8, -0.2)}))["T"] \
        .startswith("not shown: the recovering teacher")


def test_long_horizon_reader_starts_as_the_teacher(tmp_path):
    """The full-context reader's start is the teacher with more positions: the same logits as the
    teacher's own forward on an input both can read, and room for 9,000-token prompts."""
    import torch

    from agents import models

    lh = load("long_horizon")
    args = lh.parse_args(["--smoke", "--out", str(tmp_path), "--tasks", "LongQA"])
    start = lh.reader_start("LongQA", args)
    teacher, _ = models.load(lh.teacher_dir("LongQA", args))
    reader, _ = models.load(str(start))
    assert reader.config.max_position_embeddings == lh.READER["positions"] > 9_216
    assert teacher.config.max_position_embeddings < 9_216
    ids = torch.randint(0, teacher.config.vocab_size, (2, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reader(ids).logits, teacher(ids).logits)


def test_on_policy_recovery_smoke_and_rerun(tmp_path):
    """Part 2's comparison: every arm builds from the start (DAgger pools its rounds), is read clean
    and perturbed, and counts its training states; a rerun recomputes nothing."""
    recovery = load("on_policy_recovery")
    assert recovery.main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "recovery.json").read_text())
    task = "LongQA-twice"  # LongQA with each fact stated twice, by default
    assert results["tasks"][task]["fact_repeats"] == 2 and "--tasks" not in results["command"]
    assert {r["arm"] for r in results["rows"]} == set(recovery.ARMS)
    assert set(results["references"]) == {f"{task}/start", f"{task}/teacher", f"{task}/start-states"}
    assert results["references"][f"{task}/start-states"]["calls"] == 8 * 4  # 8 episodes of 3 writes and an answer
    data = (tmp_path / task / "recovery" / "sft-oracle-s0" / "data" / "summary.json").read_text()
    assert '"fact_repeats": 2' in data  # the arms' data come from the task's env
    home = tmp_path / task / "recovery"
    assert set(json.loads((home / "dagger-s0" / "build.json").read_text())) == {"sample", "relabel", "sft"}
    rounds = [len((home / "dagger-s0" / f"round-{r}" / "pooled.jsonl").read_text().splitlines()) for r in (0, 1)]
    assert rounds == [4, 8]  # 8 trajectories over 2 rounds, aggregated
    labelled = (home / "dagger-s0" / "round-0" / "labelled.jsonl").read_text()
    assert '"relabelled_by"' in labelled
    for row in results["rows"]:
        assert row["states"]["calls"] > 0 and row["recovery"]["episodes"] + row["no_recovery"]["episodes"] > 0
    assert results["verdicts"][task].startswith("not tested yet")
    stamps = [p.stat().st_mtime_ns for p in sorted((tmp_path / "rows-recovery").iterdir())]
    assert recovery.main(["--smoke", "--out", str(tmp_path), "--cached-only"]) == 0
    assert [p.stat().st_mtime_ns for p in sorted((tmp_path / "rows-recovery").iterdir())] == stamps


def test_on_policy_recovery_counts_wrong_memory_states_by_hand(tmp_path):
    """The reader oracle after a distractor at chunk 0 holds the wrong sentence in the memory of every
    call up to the chunk with the fact (that one a state to recover from), or in every later call when
    the fact was in chunk 0: counted from the sample's fact chunk, not from the frames; the clean
    oracle's states are all on the oracle's path."""
    from agents.records import load_episodes
    from memopd.eval import evaluate

    lh, recovery = load("long_horizon"), load("on_policy_recovery")
    one = lh.parse_args(["--out", str(tmp_path), "--tasks", "LongQA"])
    evaluate([*lh.env_argv("LongQA", 6), "--agent", "oracle", "--agent-kwarg", "script=reader", "--model",
              lh.STUDENT, "--split", "train", "--episodes", "24", "--memory-perturbation", "distractor@0",
              "--no-progress", "--out", str(tmp_path / "eps")])
    path = tmp_path / "eps" / "episodes.jsonl"
    import gymnasium as gym

    source = gym.make("memgym/LongQA-v0", split="train", **{**lh.TASKS["LongQA"], "num_chunks": 6}).unwrapped.source
    wrong = recoverable = calls = 0
    for e in load_episodes(path).episodes:
        at = source[source.index_of(e.sample_id)].supporting_facts[0]["chunk"]
        calls += len(e.invocations)  # 6 memory writes and the answer
        wrong += 6 if at == 0 else at
        recoverable += at > 0
    got = recovery.wrong_states("LongQA", [path], one)
    assert got == {"calls": calls, "off_oracle": wrong, "off_oracle_fact_in_chunk": recoverable, "wrong_frame": wrong}
    assert 0 < recoverable < 24
    evaluate([*lh.env_argv("LongQA", 6), "--agent", "oracle", "--model", lh.STUDENT, "--split", "train", "--episodes",
              "8", "--no-progress", "--out", str(tmp_path / "clean")])  # the oracle's own states: none off it
    clean = recovery.wrong_states("LongQA", [tmp_path / "clean" / "episodes.jsonl"], one)
    assert clean == {"calls": 56, "off_oracle": 0, "off_oracle_fact_in_chunk": 0, "wrong_frame": 0}


def test_on_policy_recovery_verdicts_by_hand():
    recovery = load("on_policy_recovery")

    def arm(loss, se, seeds=3):
        return {"seeds": seeds, "loss": loss, "loss_se": se}

    base = {"sft-oracle": arm(-0.35, 0.02), "sft-teacher": arm(-0.30, 0.03)}
    said = recovery.verdict({**base, "dagger": arm(-0.05, 0.02), "memopd": arm(-0.10, 0.03)})
    assert said == "holds: dagger loses less than sft-oracle by 0.300 ± 0.028, sft-teacher by 0.250 ± 0.036"
    said = recovery.verdict({**base, "dagger": arm(-0.25, 0.02), "memopd": arm(-0.28, 0.03)})
    assert said.startswith("does not hold: dagger against sft-oracle +0.100 ± 0.028, sft-teacher +0.050")
    assert recovery.verdict({**base, "memopd": arm(-0.05, 0.02, seeds=2)}).startswith("not tested yet")
    assert recovery.verdict(base).startswith("not tested yet")


@pytest.mark.slow
def test_smollm2_at_length_smoke_distances_and_rerun(tmp_path):
    """Part 4: the students trained once, every policy read at each length; the chunks read after the
    fact found again by replaying the env in the model's tokens; a rerun recomputes nothing."""
    import gymnasium as gym

    from agents.models import load_tokenizer

    part4 = load("smollm2_at_length")
    assert part4.main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "at-length" / "results.json").read_text())
    assert {(r["policy"], r["num_chunks"]) for r in results["rows"]} == {
        (p, n) for p in part4.POLICIES for n in part4.SMOKE["lengths"]}
    assert (tmp_path / "export" / "student" / "config.json").is_file() and (tmp_path / "fullcontext").is_dir()
    row = next(r for r in results["rows"] if r["policy"] == "memopd" and r["num_chunks"] == 3)
    env = gym.make(part4.sm.ENV, split="test", tokenizer=load_tokenizer("tiny"), **part4.env_kwargs(3))
    for sample_id, distance in zip(row["sample_ids"], row["distances"]):
        index = env.unwrapped.source.index_of(sample_id)
        obs, info = env.reset(options={"index": index})
        fact = env.unwrapped.source[index].supporting_facts[0]["text"]
        seen = []
        while info["phase"] == "memory":
            seen.append(fact in info["chunk"])
            obs, _, _, _, info = env.step("")
        assert distance == len(seen) - 1 - seen.index(True)
    stamps = [p.stat().st_mtime_ns for p in sorted((tmp_path / "at-length" / "rows").iterdir())]
    assert part4.main(["--smoke", "--out", str(tmp_path), "--cached-only"]) == 0
    assert [p.stat().st_mtime_ns for p in sorted((tmp_path / "at-length" / "rows").iterdir())] == stamps


@pytest.mark.slow
def test_aligned_vs_persistent_smoke_and_rerun(tmp_path):
    """Part 3: teachers built by the recipe with their seeds and shapes, both contexts trained at each
    length, every teacher's shift on the warm start's states; a rerun recomputes nothing."""
    avp = load("aligned_vs_persistent")
    assert avp.main(["--smoke", "--out", str(tmp_path)]) == 0
    home = tmp_path / "LongQA" / "aligned-vs-persistent"
    results = json.loads((home / "results.json").read_text())
    assert {(r["teacher"], r["context"], r["num_chunks"]) for r in results["runs"]} == {
        (t, c, n) for t in avp.SMOKE["teachers"] for c in avp.CONTEXTS for n in avp.SMOKE["lengths"]}
    assert json.loads((home / "teachers" / "small" / "sft_config.json").read_text())["model"] == "tiny-digits"
    # each aligned run trained at L is also read at 32L (part 1's claim with that teacher build)
    assert {r["teacher"] for r in results["runs"] if "f1_at_32L" in r} == set(avp.SMOKE["teachers"])
    assert all(("f1_at_32L" in r) == (r["context"] == "aligned" and r["num_chunks"] == 3) for r in results["runs"])
    config = (home / "runs" / "t1-persistent-4-s0" / "config.toml").read_text()
    assert 'teacher_context = "persistent"' in config and "num_chunks = 4" in config
    for s in results["shifts"]:  # no history before the first call: the two contexts agree there
        assert s["turns"][0]["turn"] == 0 and abs(s["turns"][0]["mean"]) < 1e-5 and s["kl"] > 0
    stamps = [p.stat().st_mtime_ns for p in sorted((home / "rows").iterdir())]
    assert avp.main(["--smoke", "--out", str(tmp_path), "--cached-only"]) == 0
    assert [p.stat().st_mtime_ns for p in sorted((home / "rows").iterdir())] == stamps


def test_aligned_vs_persistent_gaps_and_verdicts_by_hand():
    import statistics

    avp = load("aligned_vs_persistent")
    f1 = {("a", "aligned"): [0.8, 0.6], ("a", "persistent"): [0.5, 0.5], ("b", "aligned"): [0.4, 0.4],
          ("b", "persistent"): [0.5, 0.5], ("c", "aligned"): [0.9, 0.7], ("c", "persistent"): [0.6, 0.6]}
    runs = [{"teacher": t, "context": c, "num_chunks": 6, "seed": s, "f1": x}
            for (t, c), xs in f1.items() for s, x in enumerate(xs)]
    shifts = [{"teacher": t, "num_chunks": 6, "kl": k} for t, k in (("a", 0.3), ("b", 0.1), ("c", 0.5))]
    got = avp.summarise(runs, shifts, {"a": 0.9, "b": 0.8, "c": 0.95})["lengths"]["6"]
    gaps = [0.7 - 0.5, 0.4 - 0.5, 0.8 - 0.6]
    assert [got["teachers"][t]["gap"] for t in "abc"] == pytest.approx(gaps)
    assert got["mean_gap"] == pytest.approx(statistics.mean(gaps))
    assert got["sd_gap"] == pytest.approx(statistics.stdev(gaps)) and got["positive"] == 2
    # one gap negative, and the mean (0.1) within two standard errors over teachers (2 x 0.1)
    assert got["verdict"].startswith("does not hold")
    assert avp.verdict([0.1, 0.2, 0.05], None).startswith("holds")
    assert avp.verdict([0.3, -0.01, 0.3, 0.3], statistics.stdev([0.3, -0.01, 0.3, 0.3]) / 2).startswith("holds")
    assert avp.verdict([0.1, 0.2], 0.01).startswith("not tested yet")
    # a teacher the recipe did not teach gets no runs (in a smoke run every teacher does)
    assert avp.fair({"a": 0.86, "b": 0.02, "c": avp.FAIR_F1}) == ["a", "c"]
    assert avp.fair({"a": 0.86, "b": 0.02}, smoke=True) == ["a", "b"]
    assert avp.pearson([0.3, 0.1, 0.5], gaps) == pytest.approx(statistics.correlation([0.3, 0.1, 0.5], gaps))
