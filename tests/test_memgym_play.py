"""The interactive CLI: a scripted player, end of input, bad ids, --env-kwarg parsing, errors as tools give them."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

import memgym  # noqa: F401
from memgym.cli import CLIError
from memgym.play import parse_args, play

REPO = Path(__file__).resolve().parent.parent


def test_a_scripted_player_sees_the_score():
    env = gym.make("memgym/LongQA-v0", num_chunks=3, hops=2)
    _, info = env.reset(seed=4)
    sample = env.unwrapped._sample
    facts = [f["text"] for f in sample.supporting_facts]
    lines, memory = [], ""
    while info["phase"] == "memory":
        memory = " ".join([memory] + [f for f in facts if f in info["chunk"]]).strip()
        lines.append(memory)
        _, _, _, _, info = env.step(memory)
    lines.append(sample.answers[0])
    out = io.StringIO()
    code = play(["memgym/LongQA-v0", "--seed", "4", "--env-kwarg", "num_chunks=3", "--env-kwarg", "hops=2"],
                stdin=io.StringIO("\n".join(lines) + "\n"), stdout=out)
    assert code == 0
    assert "Reward (f1): 1.000" in out.getvalue() and f"Gold answer(s): {sample.answers[0]}" in out.getvalue()


def test_end_of_input_stops_cleanly():
    out = subprocess.run([sys.executable, "-m", "memgym.play", "memgym/LongQA-v0", "--seed", "0"], input="",
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0 and "end of input" in out.stdout and "Traceback" not in out.stderr


def test_unknown_env_lists_ids_without_a_traceback():
    out = subprocess.run([sys.executable, "-m", "memgym.play", "memgym/Nope-v0"], input="", capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2 and "memgym/LongQA-v0" in out.stderr and "Traceback" not in out.stderr


def run_play(*argv, input="", env=None, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "memgym.play", *argv], input=input, capture_output=True,
                          text=True, cwd=cwd, timeout=60, env=env)


def test_env_kwargs_are_typed_make_kwargs():
    args, kwargs = parse_args(["LongQA", "--seed", "3", "--env-kwarg", "chunk_size=48", "--env-kwarg",
                               "fact_order=random", "--env-kwarg", "distractor_similarity=0.25",
                               "--env-kwarg", "tokenizer=some/dir"])
    assert args.env_id == "LongQA" and args.seed == 3
    assert kwargs == {"chunk_size": 48, "fact_order": "random", "distractor_similarity": 0.25,
                      "tokenizer": "some/dir"}
    with pytest.raises(CLIError, match="--env-kwarg 'hops' is not KEY=VALUE"):
        parse_args(["LongQA", "--env-kwarg", "hops"])


def test_the_old_key_value_options_are_a_usage_error():
    out = run_play("LongQA", "--hops", "2")
    assert out.returncode == 2 and "unrecognized arguments: --hops 2" in out.stderr


def test_help_lists_the_available_envs():
    out = run_play("--help")
    assert out.returncode == 0 and "--env-kwarg KEY=VALUE" in out.stdout
    builtin = [p.name for p in (REPO / "tasks").iterdir() if (p / "task.toml").is_file()]
    assert len(builtin) >= 4
    for name in builtin:
        assert f"memgym/{name}-v0" in out.stdout


@pytest.mark.parametrize("argv,message", [
    (["LongQA", "--env-kwarg", "chunk_size=0"], "error: could not make LongQA: chunk_size must be an int >= 1"),
    (["LongQA", "--env-kwarg", "nokey"], "error: --env-kwarg 'nokey' is not KEY=VALUE"),
    (["LongQA", "--index", "-1"], "error: could not reset LongQA: reset option index"),
])
def test_bad_input_is_one_error_line_and_exit_2(argv, message):
    out = run_play(*argv)
    assert out.returncode == 2 and out.stderr.startswith(message) and "Traceback" not in out.stderr


def test_a_binary_task_data_file_is_named(tmp_path):
    folder = tmp_path / "Binary"
    folder.mkdir()
    (folder / "task.toml").write_text('name = "BinaryQA"\ndata = "data.jsonl"\n')
    data = folder / "data.jsonl"
    data.write_bytes(json.dumps({"id": "q", "question": "?", "answers": ["a"], "documents": []}).encode()
                     + b"\n\xff\xfe\x00\x01binary\n")
    out = run_play("BinaryQA", env={**os.environ, "MEMGYM_TASKS": str(tmp_path)}, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{data.resolve()}:2: not UTF-8 text" in out.stderr
