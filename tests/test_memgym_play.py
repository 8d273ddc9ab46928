"""The interactive CLI: a scripted player, end of input, bad ids and kwargs parsing."""

import io
import subprocess
import sys
from pathlib import Path

import gymnasium as gym

import memgym  # noqa: F401
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
    code = play(["memgym/LongQA-v0", "--seed", "4", "--num-chunks", "3", "--hops", "2"],
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


def test_extra_options_become_typed_make_kwargs():
    args, kwargs = parse_args(["LongQA", "--seed", "3", "--chunk-size", "48", "--fact-order=random",
                               "--distractor-similarity", "0.25", "--tokenizer", "some/dir"])
    assert args.env_id == "LongQA" and args.seed == 3
    assert kwargs == {"chunk_size": 48, "fact_order": "random", "distractor_similarity": 0.25,
                      "tokenizer": "some/dir"}
