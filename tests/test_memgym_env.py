"""The memgym environment: Gymnasium conformance, episode semantics, budgets, bad input."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import memgym
from memgym.chunking import iter_chunks
from memgym.scoring import score_answer

BUILTIN_SYNTHETIC = ["memgym/LongQA-v0", "memgym/NeedleQA-v0"]
INFO_KEYS = {"task_id", "sample_id", "question", "phase", "chunk", "chunk_index", "num_chunks", "memory",
             "memory_size", "memory_budget", "budget_unit", "memory_truncated", "memory_cut"}
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tokenizer():
    from memgym.generators.longqa import tokenizer_corpus

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(True)])
    tok.train_from_iterator(tokenizer_corpus(60), trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def oracle_episode(env, seed=None, options=None):
    """Play one episode copying the supporting facts into memory; returns every step's output."""
    obs, info = env.reset(seed=seed, options=options)
    facts = [f["text"] for f in env.unwrapped._sample.supporting_facts]
    trace = [(obs, info)]
    while info["phase"] != "done":
        if info["phase"] == "memory":
            action = " ".join([info["memory"]] + [f for f in facts if f in info["chunk"]]).strip()
        else:
            action = env.unwrapped._sample.answers[0]
        trace.append(env.step(action))
        info = trace[-1][-1]
    return trace


@pytest.mark.parametrize("env_id", BUILTIN_SYNTHETIC)
def test_check_env_passes(env_id):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(gym.make(env_id).unwrapped)
        # The wrapped env with gymnasium's default passive checker runs without a warning.
        env = gym.make(env_id, render_mode="ansi")
        env.reset(seed=0)
        env.step("some memory")
        assert isinstance(env.render(), str)


def test_check_env_passes_with_a_tokenizer(tokenizer):
    check_env(gym.make("memgym/LongQA-v0", tokenizer=tokenizer).unwrapped)


def test_module_prefixed_id_and_short_ids():
    assert gym.make("memgym:memgym/LongQA-v0").unwrapped.task.name == "LongQA"
    assert memgym.make("LongQA").unwrapped.task.id == "memgym/LongQA-v0"
    assert memgym.make("NeedleQA-v0").unwrapped.task.id == "memgym/NeedleQA-v0"


def test_unknown_id_lists_the_available_ones():
    with pytest.raises(memgym.UnknownEnvError) as exc:
        memgym.make("memgym/LongQB-v0")
    assert "memgym/LongQA-v0" in str(exc.value) and "memgym/NeedleQA-v0" in str(exc.value)
    assert isinstance(exc.value, gym.error.NameNotFound)


@pytest.mark.parametrize("env_id", BUILTIN_SYNTHETIC)
def test_oracle_episode_semantics(env_id):
    env = gym.make(env_id)
    trace = oracle_episode(env, seed=5)
    obs, info = trace[0]
    n = info["num_chunks"]
    assert INFO_KEYS <= set(info) and info["phase"] == "memory" and info["chunk_index"] == 0
    assert info["question"] in obs and info["chunk"] in obs
    assert len(trace) == n + 2  # reset, n memory writes, one answer
    sample = env.unwrapped._sample
    chunks = [c.text for c in iter_chunks(sample.documents, env.unwrapped.chunk_size, env.unwrapped.counter)]
    for t, (_, reward, terminated, truncated, info) in enumerate(trace[1:-1], start=1):
        assert reward == 0.0 and not terminated and not truncated
        assert info["phase"] == ("memory" if t < n else "answer")
        if t < n:
            assert info["chunk"] == chunks[t] and info["chunk_index"] == t
        else:
            assert info["chunk"] == ""
    obs, reward, terminated, truncated, info = trace[-1]
    assert terminated and not truncated and info["phase"] == "done"
    assert reward == 1.0 and info["metrics"] == {"em": 1.0, "f1": 1.0, "sub_em": 1.0}
    assert info["answers"] == sample.answers and info["prediction"] == sample.answers[0]
    assert all(f["text"] in info["memory"] for f in sample.supporting_facts)


def test_same_seed_and_options_give_the_same_episode():
    a, b = gym.make("memgym/LongQA-v0", hops=2), gym.make("memgym/LongQA-v0", hops=2)
    assert oracle_episode(a, seed=11) == oracle_episode(b, seed=11)
    assert oracle_episode(a, seed=11)[0] != oracle_episode(a, seed=12)[0]
    sid = a.reset(seed=3)[1]["sample_id"]
    by_id = oracle_episode(b, options={"sample_id": sid})
    assert by_id == oracle_episode(a, seed=3)
    index = a.unwrapped.source.index_of(sid)
    assert oracle_episode(b, seed=99, options={"index": index}) == by_id


def test_reward_follows_the_scorer_and_the_scoring_module():
    for scorer in ("f1", "em", "sub_em"):
        env = gym.make("memgym/LongQA-v0", scorer=scorer)
        _, info = env.reset(seed=2)
        while info["phase"] == "memory":
            _, _, _, _, info = env.step("")
        gold = env.unwrapped._sample.answers
        prediction = f"the {gold[0]} company"
        _, reward, terminated, _, info = env.step(prediction)
        expected = score_answer(prediction, gold)
        assert terminated and reward == pytest.approx(expected[scorer])
        assert info["metrics"] == pytest.approx(expected)


def test_memory_budget_in_tokens_of_the_default_tokenizer_cuts_and_reports():
    from memgym.chunking import default_tokenizer

    env = gym.make("memgym/LongQA-v0", memory_budget=5)  # no tokenizer: memgym's default one counts
    env.reset(seed=0)
    action = "one two  three four five six seven"
    enc = default_tokenizer().encode(action, add_special_tokens=False)
    _, _, _, _, info = env.step(action)
    assert info["memory"] == action[: enc.offsets[4][1]]
    assert (info["memory_size"], info["memory_truncated"], info["memory_cut"], info["budget_unit"]) == \
        (5, True, len(enc.ids) - 5, "tokens")
    _, _, _, _, info = env.step("short memory")
    assert (info["memory"], info["memory_truncated"], info["memory_cut"]) == ("short memory", False, 0)


def test_memory_budget_and_chunks_in_tokens(tokenizer):
    env = gym.make("memgym/LongQA-v0", tokenizer=tokenizer, chunk_size=80, memory_budget=7, num_chunks=4)
    _, info = env.reset(seed=1)
    assert info["budget_unit"] == "tokens" and info["num_chunks"] == 4
    action = "alice acme . bob globex . carol initech ."
    enc = tokenizer(action, add_special_tokens=False, return_offsets_mapping=True)
    _, _, _, _, info2 = env.step(action)
    assert info2["memory"] == action[: enc["offset_mapping"][6][1]]
    assert (info2["memory_size"], info2["memory_cut"]) == (7, len(enc["input_ids"]) - 7)
    chunk_tokens = len(tokenizer(info["chunk"], add_special_tokens=False)["input_ids"])
    assert chunk_tokens <= 80


def test_tokenizer_given_by_name_is_loaded_lazily(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path)
    env = gym.make("memgym/LongQA-v0", tokenizer=str(tmp_path))
    assert env.reset(seed=0)[1]["budget_unit"] == "tokens"


def test_context_length_and_num_chunks():
    assert gym.make("memgym/LongQA-v0", num_chunks=3).reset(seed=0)[1]["num_chunks"] == 3
    env = gym.make("memgym/LongQA-v0", context_length=640, chunk_size=128)
    assert env.reset(seed=0)[1]["num_chunks"] == 5
    with pytest.raises(ValueError, match="not both"):
        gym.make("memgym/LongQA-v0", context_length=640, num_chunks=3)


def test_bad_input_gets_clear_errors():
    env = gym.make("memgym/LongQA-v0").unwrapped
    with pytest.raises(memgym.ResetNeededError, match="reset"):
        env.step("x")
    env.reset(seed=0)
    with pytest.raises(TypeError, match="must be a str.*int"):
        env.step(42)
    with pytest.raises(TypeError, match="list"):
        env.step(["a"])
    while True:
        *_, terminated, _, info = env.step("x")
        if terminated:
            break
    with pytest.raises(memgym.EpisodeEndedError, match="reset"):
        env.step("again")
    assert isinstance(memgym.EpisodeEndedError("x"), RuntimeError)
    with pytest.raises(ValueError, match="sample_id"):
        env.reset(options={"sample_id": "nope"})
    with pytest.raises(ValueError, match="unknown reset option"):
        env.reset(options={"idx": 1})
    with pytest.raises(ValueError, match="scorer"):
        gym.make("memgym/LongQA-v0", scorer="bleu")
    with pytest.raises(TypeError, match="unknown option"):
        gym.make("memgym/LongQA-v0", hopz=2)


def test_unicode_actions_and_space():
    env = gym.make("memgym/LongQA-v0", memory_budget=64)
    env.reset(seed=0)
    memory = "Zoë → 東京 🙂 naïve"
    assert env.action_space.contains(memory) and not env.action_space.contains(b"bytes")
    _, _, _, _, info = env.step(memory)
    assert info["memory"] == memory
    sample = env.action_space.sample()
    assert isinstance(sample, str) and sample.isprintable() or "\n" in sample


def test_make_vec_sync_steps():
    envs = gym.make_vec("memgym/LongQA-v0", num_envs=4, vectorization_mode="sync")
    obs, infos = envs.reset(seed=0)
    assert len(obs) == 4 and len(set(infos["sample_id"])) == 4
    n = int(infos["num_chunks"][0])
    for _ in range(n):
        obs, rewards, terminated, truncated, infos = envs.step(("memory",) * 4)
    obs, rewards, terminated, truncated, infos = envs.step(("answer",) * 4)
    assert terminated.all() and not truncated.any() and rewards.shape == (4,)
    envs.close()


def test_render_ansi_returns_the_observation():
    env = gym.make("memgym/NeedleQA-v0", render_mode="ansi")
    obs, _ = env.reset(seed=0)
    assert env.render() == obs + "\n"
    plain = gym.make("memgym/NeedleQA-v0")
    plain.reset(seed=0)
    assert plain.render() is None


def test_import_memgym_does_not_import_torch():
    code = "import sys, memgym, memgym.env, memgym.play; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_readme_env_loop_runs_as_written():
    readme = (REPO / "README.md").read_text(encoding="utf-8") if (REPO / "README.md").exists() else ""
    match = re.search(r"<!-- memgym:env-loop -->\s*```python\n(.*?)```", readme, re.S)
    assert match, "README.md must hold the env.step() loop in a ```python block after <!-- memgym:env-loop -->"
    answers = "\n".join(["alice acme ."] * 40)
    out = subprocess.run([sys.executable, "-c", match.group(1)], input=answers, capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"\b[01]\.\d+ \{'em'", out.stdout), out.stdout


HUGE = 1 << 20  # the default max_text_length: an action of this many characters is inside action_space


@pytest.mark.parametrize("action,budget", [("x" * HUGE, 16), (("word " * HUGE)[:HUGE], 10**6)],
                         ids=["one 1 MiB word", "1 MiB of words within the budget"])
def test_a_1mib_action_never_breaks_the_env(action, budget):
    env = gym.make("memgym/LongQA-v0", memory_budget=budget)
    obs, info = env.reset(seed=0)
    assert env.action_space.contains(action)
    while info["phase"] == "memory":
        obs, _, _, _, info = env.step(action)
        assert env.observation_space.contains(obs) and info["memory"] in obs
        assert info["memory_truncated"] and info["memory_cut"] >= 1 and action.startswith(info["memory"])
        assert info["memory_size"] == env.unwrapped.counter.count(info["memory"])
    obs, reward, terminated, _, info = env.step(action)
    assert terminated and env.observation_space.contains(obs) and info["prediction"] == action


def test_an_action_outside_the_space_is_refused_before_the_episode_moves():
    env = gym.make("memgym/LongQA-v0", max_text_length=2000)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="2001 characters, more than the action space's max_text_length=2000"):
        env.step("y" * 2001)
    _, _, _, _, info = env.step("short")
    assert info["chunk_index"] == 1 and info["memory"] == "short"


@pytest.mark.parametrize("kwargs,message", [
    ({"chunk_size": 10**9}, r"chunk_size=1000000000 tokens cannot fit .* use chunk_size <= 1048576"),
    ({"chunk_size": 1200, "max_text_length": 1000}, r"use chunk_size <= 1000, or raise max_text_length"),
    ({"memory_budget": 0}, r"memory_budget must be an int >= 1, got 0"),
    ({"split": "dev"}, r"no split 'dev'; its splits are \['train', 'test'\]"),
])
@pytest.mark.parametrize("env_id", BUILTIN_SYNTHETIC)
def test_impossible_settings_are_refused_at_make(env_id, kwargs, message):
    with pytest.raises(ValueError, match=message):
        gym.make(env_id, **kwargs)


def test_reset_options_must_be_a_dict():
    env = gym.make("memgym/LongQA-v0")
    with pytest.raises(TypeError, match=r"reset options must be a dict such as .* got int 5"):
        env.reset(options=5)


def test_a_sample_that_cannot_be_packed_is_named():
    """A plan the chunk size cannot pack fails with the sample's id (to replay it with reset options)
    and the chunk size to pass; the same sample replayed by id fails the same way."""
    env = gym.make("memgym/VariableTracking-v0", chunk_size=24, numbering="random", num_chunks=6)

    def play(**reset) -> None:
        env.reset(**reset)
        terminated = False
        while not terminated:
            _, _, terminated, _, _ = env.step("x")

    with pytest.raises(ValueError, match=r"^sample (\S+) of split 'train' \(reset option .*chunk \d+: .*chunk_size=24 "
                                         r"tokens is too small.*pass chunk_size=\d+") as first:
        play(seed=0)
    sample_id = re.match(r"sample (\S+) ", str(first.value)).group(1)
    with pytest.raises(ValueError, match=f"^sample {re.escape(sample_id)} "):
        play(options={"sample_id": sample_id})
    env.close()
