"""Bad input is one ``error:`` line naming the flag, file or key to fix, with exit 2 (issue 31):
sampling flags, env options memopd.eval sets itself, task folders whose source cannot be used,
data the oracle cannot script, a full disk, a tokenizer path that is not there, a resume whose
``latest`` names a missing checkpoint, and gymnasium's checker after a failed first reset."""

from __future__ import annotations

import errno
import io
import json
import textwrap
import uuid
import warnings
from pathlib import Path

import gymnasium as gym
import pytest
import torch

import memgym
from memgym.cli import run_main
from memgym.play import play
from memgym.registry import load_task, register_tasks
from memopd import checkpoint
from memopd.eval import main

SAMPLE = {"id": "q1", "question": "Where does Ada live?", "answers": ["Paris"],
          "documents": [{"title": "Ada", "text": "Ada lives in Paris. She likes tea."}]}


def fails(argv, capsys) -> str:
    """``memopd.eval`` with ``argv`` must exit 2 with exactly one ``error:`` line on stderr."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def play_fails(argv, capsys) -> str:
    """``memgym.play`` (as its ``main`` runs it) must exit 2 with exactly one ``error:`` line."""
    assert run_main(lambda: play(argv, stdin=io.StringIO(""), stdout=io.StringIO())) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def task(root: Path, toml: str, files: dict[str, str] | None = None) -> tuple[str, Path]:
    """A task folder under ``root`` with a fresh name: ``(env id, folder)``. ``toml`` follows the name line."""
    name = f"Bad{uuid.uuid4().hex[:8]}"
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "task.toml").write_text(f'name = "{name}"\n{toml}')
    for file, text in (files or {}).items():
        (folder / file).write_text(text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a folder that fails validation is skipped with a warning
        register_tasks([root])
    return f"memgym/{name}-v0", folder


def out_args(tmp_path: Path) -> list[str]:
    return ["--episodes", "1", "--out", str(tmp_path / "out"), "--no-progress", "--threads", "1"]


# ---------------------------------------------------------------- sampling flags, before any model loads
@pytest.mark.parametrize("flag,value,says,got", [
    ("--temperature", "nan", "--temperature must be a finite number", "nan"),
    ("--temperature", "inf", "--temperature must be a finite number", "inf"),
    ("--top-p", "-1", "--top-p must be in (0, 1]", "-1.0"),
    ("--top-p", "nan", "--top-p must be in (0, 1]", "nan"),
    ("--max-new-tokens", "-5", "--max-new-tokens must be >= 1", "-5"),
    ("--answer-max-new-tokens", "0", "--answer-max-new-tokens must be >= 1", "0"),
])
def test_bad_sampling_flags_are_refused_before_the_model_loads(tmp_path, capsys, monkeypatch, flag, value, says,
                                                               got):
    import agents.models

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(agents.models, "load", no_load)
    monkeypatch.setattr(agents.models, "load_tokenizer", no_load)
    err = fails(["--agent", "memagent", "--model", "tiny", flag, value, *out_args(tmp_path)], capsys)
    assert err.startswith(f"error: {says}") and err.endswith(f"got {got}\n")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- env options memopd.eval sets itself
@pytest.mark.parametrize("kwarg,flag", [("tokenizer=/no/such/dir", "--model"), ("split=train", "--split")])
def test_an_env_kwarg_the_cli_sets_itself_names_its_flag(tmp_path, capsys, kwarg, flag):
    err = fails(["--agent", "oracle", "--env-kwarg", kwarg, *out_args(tmp_path)], capsys)
    key = kwarg.split("=")[0]
    assert err.startswith(f"error: --env-kwarg {kwarg}: memopd.eval gives the env its {key} from {flag}")
    assert "multiple values" not in err and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- a tokenizer path that is not there
def test_a_missing_tokenizer_directory_is_said_so(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"tokenizer='/no/such/dir': no such directory") as exc:
        gym.make("memgym/LongQA-v0", tokenizer="/no/such/dir")
    assert "Repo id" not in str(exc.value)
    err = play_fails(["LongQA", "--env-kwarg", "tokenizer=/no/such/dir"], capsys)
    assert "tokenizer='/no/such/dir': no such directory; give a directory holding a saved tokenizer" in err
    assert "Repo id" not in err
    err = play_fails(["LongQA", "--env-kwarg", f"tokenizer={tmp_path}"], capsys)  # there, but no tokenizer in it
    assert f"tokenizer='{tmp_path}': the directory holds no tokenizer files (tokenizer.json" in err


# ---------------------------------------------------------------- task folders whose source cannot be used
def test_a_source_module_that_is_not_installed_names_task_toml_and_source(tmp_path, capsys):
    env_id, folder = task(tmp_path, 'source = "nosuchpkg.mod:make_source"\n')
    with pytest.raises(memgym.TaskConfigError) as exc:
        gym.make(env_id)
    assert str(exc.value).startswith(f"{folder.resolve() / 'task.toml'}: key 'source': cannot import 'nosuchpkg.mod'")
    err = fails(["--agent", "oracle", "--env", env_id, *out_args(tmp_path)], capsys)
    assert f"{folder.resolve() / 'task.toml'}: key 'source'" in err and "no module named 'nosuchpkg'" in err
    assert "install the package" in err and "--env-kwarg" not in err
    assert f"{folder.resolve() / 'task.toml'}: key 'source'" in play_fails([env_id], capsys)


def test_a_source_module_whose_own_import_fails_says_what_it_needs(tmp_path, capsys, monkeypatch):
    (tmp_path / "brokenmod.py").write_text("import nosuchdependency\n\ndef make_source(split, seed):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env_id, folder = task(tmp_path / "tasks", 'source = "brokenmod:make_source"\n')
    err = fails(["--agent", "oracle", "--env", env_id, *out_args(tmp_path)], capsys)
    assert f"{folder.resolve() / 'task.toml'}: key 'source': importing module 'brokenmod' failed: " \
           "ModuleNotFoundError: No module named 'nosuchdependency'" in err


def test_a_source_that_is_not_a_make_source_names_task_toml_and_source(tmp_path, capsys):
    env_id, folder = task(tmp_path, 'source = "os:getcwd"\n')
    err = fails(["--agent", "oracle", "--env", env_id, *out_args(tmp_path)], capsys)
    assert f"{folder.resolve() / 'task.toml'}: key 'source': os:getcwd cannot be called as " \
           "make_source(split, seed, **options)" in err
    assert "posix.getcwd() takes no arguments" not in err


def test_a_source_that_returns_no_sample_source_is_named(tmp_path):
    env_id, folder = task(tmp_path, 'source = "generator.py:make_source"\n',
                          {"generator.py": "def make_source(split, seed):\n    return [split, seed]\n"})
    with pytest.raises(memgym.TaskConfigError, match=r"key 'source': generator.py:make_source returned list .*"
                                                     r"not a sample source"):
        gym.make(env_id)


@pytest.mark.parametrize("code,line,says", [
    ("import json\nx = 1\nraise RuntimeError('boom')\n", 3, "RuntimeError: boom"),
    ("def make_source(split, seed)\n    return None\n", 1, "SyntaxError: "),
    ("import nosuchdependency\n", 1, "ModuleNotFoundError: No module named 'nosuchdependency'"),
])
def test_a_generator_that_raises_at_import_names_the_file_and_line(tmp_path, capsys, code, line, says):
    env_id, folder = task(tmp_path, 'source = "generator.py:make_source"\n', {"generator.py": code})
    generator = folder.resolve() / "generator.py"
    err = fails(["--agent", "oracle", "--env", env_id, *out_args(tmp_path)], capsys)
    assert f"{folder.resolve() / 'task.toml'}: key 'source': importing {generator}, line {line} failed: {says}" in err
    assert err.rstrip().endswith("fix generator.py")
    assert f"importing {generator}, line {line} failed" in play_fails([env_id], capsys)


@pytest.mark.parametrize("toml,key", [('source = "/no/such/gen.py:make_source"\n', "source"),
                                      ('data = "/no/such/data.jsonl"\n', "data"),
                                      ('[data]\ntest = "/no/such/test.jsonl"\n', "data.test")])
def test_an_absolute_path_that_is_not_there_is_said_so(tmp_path, capsys, toml, key):
    folder = tmp_path / "Abs"
    folder.mkdir()
    (folder / "task.toml").write_text(f'name = "Abs"\n{toml}')
    with pytest.raises(memgym.TaskConfigError) as exc:
        load_task(folder)
    message = str(exc.value)
    assert message.startswith(f"{folder / 'task.toml'}: key '{key}': file '/no/such/")
    assert "not found (an absolute path is used as given); fix the path" in message and "not found in" not in message
    env_id, folder = task(tmp_path / "tasks", toml)  # memopd.eval: the unknown id says why its folder was skipped
    err = fails(["--agent", "oracle", "--env", env_id, *out_args(tmp_path)], capsys)
    assert f"unknown env '{env_id}'" in err and "task folders that failed to load: " in err
    assert f"{folder / 'task.toml'}: key '{key}': file '/no/such/" in err


# ---------------------------------------------------------------- the oracle on data without supporting facts
@pytest.mark.parametrize("facts,says", [(None, "has no supporting_facts"),
                                        ([["Ada", 0]], "supporting_facts[0] = ['Ada', 0] has no sentence text")])
def test_the_oracle_on_samples_without_fact_sentences_names_the_file(tmp_path, capsys, facts, says):
    sample = dict(SAMPLE, **({"supporting_facts": facts} if facts is not None else {}))
    env_id, folder = task(tmp_path, 'data = "data.jsonl"\n', {"data.jsonl": json.dumps(sample) + "\n"})
    err = fails(["--agent", "oracle", "--env", env_id, *out_args(tmp_path)], capsys)
    assert err.startswith(f"error: --agent oracle: sample 'q1' of {folder.resolve() / 'data.jsonl'}")
    assert says in err and "or evaluate an agent that calls a model" in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- a full disk names the file
@pytest.mark.parametrize("file", ["episodes.jsonl", "summary.json"])
def test_a_full_disk_names_the_output_file(tmp_path, capsys, monkeypatch, file):
    import agents.rollout

    def full(*args, **kwargs):  # what a write() on a full disk raises: no file name
        raise OSError(errno.ENOSPC, "No space left on device")

    if file == "episodes.jsonl":
        monkeypatch.setattr(agents.rollout, "save_episodes", full)
    else:
        write_text = Path.write_text
        monkeypatch.setattr(Path, "write_text",
                            lambda self, *a, **k: full() if self.name == file else write_text(self, *a, **k))
    out = tmp_path / "out"
    err = fails(["--agent", "oracle", *out_args(tmp_path)], capsys)
    assert err == (f"error: --out {out}: {out / file}: No space left on device; free some disk space or choose "
                   "another output directory\n")
    assert not out.exists()


# ---------------------------------------------------------------- resume: latest names a missing checkpoint
def test_resume_says_when_latest_names_a_missing_checkpoint(tmp_path):
    model = torch.nn.Linear(2, 2)
    for step in (1, 2):
        checkpoint.save(tmp_path, step, {"model": model}, {"x": step}, keep=2)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step-000002"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an intact run resumes without a word
        assert checkpoint.load_latest(tmp_path, {"model": torch.nn.Linear(2, 2)})[1].name == "step-000002"
    (root / "latest").write_text("step-000003")  # e.g. a checkpoint deleted by hand, or restored without it
    with pytest.warns(RuntimeWarning) as record:
        state, path = checkpoint.load_latest(tmp_path, {"model": torch.nn.Linear(2, 2)})
    assert path.name == "step-000002" and state["x"] == 2
    assert len(record) == 1
    message = str(record[0].message)
    assert f"{root / 'latest'} names checkpoint step-000003, which is missing" in message
    assert "resuming from step-000002" in message


# ---------------------------------------------------------------- gymnasium's passive checker
def test_after_a_failed_first_reset_the_documented_workarounds_work():
    """gymnasium's PassiveEnvChecker breaks an env whose first reset raised (docs/gym.md, Environment
    kwargs): a later failed reset is harmless, and ``disable_env_checker=True`` avoids it."""
    env = gym.make("memgym/LongQA-v0", num_chunks=2)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="reset option index"):
        env.reset(options={"index": -1})
    env.reset(seed=1)
    assert env.step("x")[4]["chunk_index"] == 1
    env = gym.make("memgym/LongQA-v0", num_chunks=2, disable_env_checker=True)
    with pytest.raises(ValueError, match="reset option index"):
        env.reset(options={"index": -1})
    env.reset(seed=1)
    assert env.step("x")[4]["chunk_index"] == 1
    guide = (Path(__file__).resolve().parent.parent / "docs" / "gym.md").read_text()
    assert "disable_env_checker=True" in " ".join(guide.split())
