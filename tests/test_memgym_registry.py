"""Task folders: discovery, registration, validation errors, and new tasks added as the README says."""

import json
import os
import subprocess
import sys
import textwrap
import uuid
import warnings
from pathlib import Path

import gymnasium as gym
import pytest

import memgym
from memgym.registry import list_envs, load_task, register_tasks, resolve_id

REPO = Path(__file__).resolve().parent.parent

SAMPLES = [
    {"id": "q1", "question": "Where does Ada live?", "answers": ["Paris"],
     "documents": [{"title": "Ada", "text": "Ada lives in Paris. She likes tea."},
                   {"title": "Bob", "text": "Bob lives in Rome."}]},
    {"id": "q2", "question": "Where does Bob live?", "answers": ["Rome", "Roma"],
     "documents": [{"title": "Bob", "text": "Bob lives in Rome."}], "supporting_facts": [["Bob", 0]],
     "metadata": {"source": "handmade"}},
]


def unique(prefix="T"):
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def write_data_task(root: Path, name: str, extra: str = "") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "task.toml").write_text(f'name = "{name}"\nversion = 0\ndata = "data.jsonl"\n{extra}')
    (folder / "data.jsonl").write_text("".join(json.dumps(s) + "\n" for s in SAMPLES))
    return folder


def play(env, answer):
    _, info = env.reset(options={"sample_id": "q2"})
    while info["phase"] == "memory":
        _, _, _, _, info = env.step(info["memory"] + " " + info["chunk"])
    return env.step(answer)


def test_builtin_tasks_are_registered():
    ids = list_envs()
    assert ids == sorted(ids)
    assert {"memgym/LongQA-v0", "memgym/NeedleQA-v0"} <= set(ids)
    for task_id in ids:
        assert task_id in gym.registry


def test_resolve_id_short_forms():
    for name in ("LongQA", "LongQA-v0", "memgym/LongQA-v0", "memgym:memgym/LongQA-v0"):
        assert resolve_id(name) == "memgym/LongQA-v0"


def test_a_new_data_task_on_MEMGYM_TASKS_is_found_and_playable(tmp_path):
    name = unique("MyQA")
    write_data_task(tmp_path, name, "[env]\nchunk_size = 24\nmemory_budget = 40\n")
    code = textwrap.dedent(f"""
        import gymnasium as gym, memgym
        assert "memgym/{name}-v0" in memgym.list_envs()
        env = gym.make("memgym/{name}-v0")
        obs, info = env.reset(options={{"sample_id": "q1"}})
        while info["phase"] == "memory":
            obs, reward, terminated, truncated, info = env.step(info["chunk"])
        obs, reward, terminated, truncated, info = env.step("Paris")
        print(reward, terminated, info["num_chunks"])
    """)
    env = {**os.environ, "MEMGYM_TASKS": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1.0", "True", "2"]  # documents of 23 and 12 tokens, chunks of 24


def test_register_tasks_in_process_with_split_files(tmp_path):
    name = unique("Split")
    folder = write_data_task(tmp_path, name)
    (folder / "task.toml").write_text(f'name = "{name}"\nversion = 2\n[data]\ntrain = "data.jsonl"\ntest = "t.jsonl"\n')
    (folder / "t.jsonl").write_text(json.dumps(SAMPLES[1]) + "\n")
    assert register_tasks([tmp_path]) == [f"memgym/{name}-v2"]
    assert register_tasks([tmp_path]) == []  # idempotent
    assert len(gym.make(f"memgym/{name}-v2").unwrapped.source) == 2
    env = memgym.make(name, split="test", chunk_size=50)
    _, reward, terminated, _, info = play(env, "roma")
    assert terminated and reward == 1.0 and info["answers"] == ["Rome", "Roma"]
    with pytest.raises(ValueError, match=r"no split 'dev'.*\['test', 'train'\]"):
        gym.make(f"memgym/{name}-v2", split="dev")
    with pytest.raises(ValueError, match="does not take num_chunks"):
        gym.make(f"memgym/{name}-v2", num_chunks=3)


def test_a_generator_task_folder_works(tmp_path):
    name = unique("Gen")
    folder = tmp_path / name
    folder.mkdir()
    (folder / "task.toml").write_text(textwrap.dedent(f"""
        name = "{name}"
        version = 1
        source = "generator.py:make_source"
        [env]
        chunk_size = 16
        [source_kwargs]
        n = 4
    """))
    (folder / "generator.py").write_text(textwrap.dedent("""
        from memgym import Document, ListSource, Sample

        def make_source(split, seed, n=2):
            samples = []
            for i in range(n):
                value = str(seed * 1000 + i)
                docs = [Document(f"d{j}", f"Filler sentence number {j} here.") for j in range(3)]
                docs.insert(i % 3, Document("key", f"The code is {value}."))
                samples.append(Sample(id=f"{split}-{i}", question="What is the code?", answers=[value],
                                      documents=docs))
            return ListSource(samples, f"{split} split")
    """))
    register_tasks([tmp_path])
    env = gym.make(f"memgym/{name}-v1", data_seed=7)
    assert len(env.unwrapped.source) == 4  # [source_kwargs] default
    assert len(gym.make(f"memgym/{name}-v1", n=6).unwrapped.source) == 6  # make kwarg overrides
    _, info = env.reset(options={"index": 2})
    memory = ""
    while info["phase"] == "memory":
        if "code is" in info["chunk"]:
            memory = info["chunk"].split("The code is ")[1].split(".")[0]
        _, _, _, _, info = env.step(memory)
    _, reward, terminated, _, info = env.step(memory)
    assert terminated and reward == 1.0 and info["prediction"] == "7002"


@pytest.mark.parametrize("toml,key", [
    ('name = "X"\ndata = "data.jsonl"\ncolour = 1\n', "'colour'"),
    ('name = "9bad"\ndata = "data.jsonl"\n', "'name'"),
    ('data = "data.jsonl"\n', "'name'"),
    ('name = "X"\nversion = "one"\ndata = "data.jsonl"\n', "'version'"),
    ('name = "X"\n', "'data'"),
    ('name = "X"\ndata = "data.jsonl"\nsource = "m:f"\n', "exactly one"),
    ('name = "X"\ndata = "missing.jsonl"\n', "'data'"),
    ('name = "X"\nsource = "nofile.py:make_source"\n', "'source'"),
    ('name = "X"\nsource = "no colon"\n', "'source'"),
    ('name = "X"\ndata = "data.jsonl"\n[env]\nchunk_size = "big"\n', "'env.chunk_size'"),
    ('name = "X"\ndata = "data.jsonl"\n[env]\nchunksize = 3\n', "'env.chunksize'"),
    ('name = "X"\ndata = "data.jsonl"\n[env]\nhotpot_rules = 1\n', "'env.hotpot_rules'"),
    ('name = "X"\ndata = [1]\n', "'data'"),
    ('name = "X" data\n', "invalid TOML"),
])
def test_malformed_task_toml_names_file_and_key(tmp_path, toml, key):
    (tmp_path / "data.jsonl").write_text(json.dumps(SAMPLES[0]) + "\n")
    (tmp_path / "task.toml").write_text(toml)
    with pytest.raises(memgym.TaskConfigError) as exc:
        load_task(tmp_path)
    assert str(tmp_path / "task.toml") in str(exc.value) and key in str(exc.value)


def test_malformed_data_names_file_line_and_field(tmp_path):
    name = unique("Bad")
    folder = write_data_task(tmp_path, name)
    lines = [json.dumps(SAMPLES[0]), json.dumps({**SAMPLES[1], "answers": "Rome"})]
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n")
    register_tasks([tmp_path])
    with pytest.raises(memgym.TaskDataError, match=r"data.jsonl:2: field 'answers'"):
        gym.make(f"memgym/{name}-v0")


def test_a_broken_folder_is_skipped_with_a_warning_and_reported(tmp_path):
    name = unique("Broken")
    folder = tmp_path / name
    folder.mkdir()
    (folder / "task.toml").write_text(f'name = "{name}"\nversion = 0\n')
    with pytest.warns(UserWarning, match="skipping task folder"):
        register_tasks([tmp_path])
    with pytest.raises(memgym.UnknownEnvError, match=f"failed to load.*{name}"):
        memgym.make(f"memgym/{name}-v0")


def test_env_settings_are_one_list_and_data_seed_is_accepted_in_task_toml(tmp_path):
    from memgym.env import ENV_DEFAULTS
    from memgym.registry import ENV_KEYS

    assert set(ENV_KEYS) == set(ENV_DEFAULTS)
    name = unique("Seeded")
    write_data_task(tmp_path, name, "[env]\ndata_seed = 3\n")
    assert load_task(tmp_path / name).env == {"data_seed": 3}


def write_gen_task(root: Path, name: str, extra: str = "") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "task.toml").write_text(f'name = "{name}"\nsource = "generator.py:make_source"\n{extra}')
    (folder / "generator.py").write_text(textwrap.dedent(f"""
        from memgym import Document, ListSource, Sample

        def make_source(split, seed):
            return ListSource([Sample(id="a", question="Which split?", answers=[split],
                                      documents=[Document("t", "from {root.name}")])])
    """))
    return folder


def test_a_later_folder_shadows_an_earlier_one_with_one_warning_naming_both(tmp_path):
    name = unique("Twin")
    first, second = write_gen_task(tmp_path / "a", name), write_gen_task(tmp_path / "b", name)
    with pytest.warns(memgym.TaskShadowedWarning) as record:
        register_tasks([tmp_path / "a", tmp_path / "b"])
    assert len(record) == 1
    assert str(first.resolve()) in str(record[0].message) and str(second.resolve()) in str(record[0].message)
    _, info = gym.make(f"memgym/{name}-v0").reset(seed=0)
    assert "from b" in info["chunk"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        register_tasks([tmp_path / "a", tmp_path / "b"])  # said once


def test_a_tasks_folder_in_the_working_directory_shadowing_a_builtin_says_so(tmp_path):
    write_data_task(tmp_path / "tasks", "LongQA")
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import gymnasium as gym, memgym\n"
            "print(gym.make('memgym/LongQA-v0').reset(options={'sample_id': 'q1'})[1]['question'])\n")
    env = {k: v for k, v in os.environ.items() if k != "MEMGYM_TASKS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Where does Ada live?"  # ./tasks comes after the built-in tasks
    assert out.stderr.count("TaskShadowedWarning") == 1
    assert str(tmp_path / "tasks" / "LongQA") in out.stderr and str(REPO / "tasks" / "LongQA") in out.stderr


@pytest.mark.parametrize("toml,key", [
    ('source = "../elsewhere.py:make_source"\n', "'source'"),
    ('data = "../outside.jsonl"\n', "'data'"),
    ('data = "sub/../../outside.jsonl"\n', "'data'"),
    ('[data]\ntrain = "../outside.jsonl"\n', "'data.train'"),
])
def test_relative_paths_may_not_climb_out_of_the_task_folder(tmp_path, toml, key):
    (tmp_path / "elsewhere.py").write_text("def make_source(split, seed):\n    raise SystemExit('ran')\n")
    (tmp_path / "outside.jsonl").write_text(json.dumps(SAMPLES[0]) + "\n")
    folder = tmp_path / "Task"
    (folder / "sub").mkdir(parents=True)
    (folder / "task.toml").write_text(f'name = "Climber"\n{toml}')
    with pytest.raises(memgym.TaskConfigError, match=f"{key}: .* climbs out of the task folder"):
        load_task(folder)


def test_absolute_data_paths_are_followed_and_bad_files_are_named(tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps(SAMPLES[0]) + "\n")
    name = unique("Abs")
    folder = tmp_path / "tasks" / name
    folder.mkdir(parents=True)
    (folder / "task.toml").write_text(f'name = "{name}"\ndata = "{outside}"\n')
    register_tasks([tmp_path / "tasks"])
    assert len(gym.make(f"memgym/{name}-v0").unwrapped.source) == 1  # an absolute path is an explicit choice
    outside.write_text("just a host name\n")  # e.g. data = "/etc/hostname"
    with pytest.raises(memgym.TaskDataError, match=f"{outside}:1: invalid JSON"):
        gym.make(f"memgym/{name}-v0")
    outside.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe binary\n")
    with pytest.raises(memgym.TaskDataError, match=f"{outside}:1: not UTF-8 text"):
        gym.make(f"memgym/{name}-v0")


def test_a_generated_task_accepts_only_its_splits(tmp_path):
    name = unique("Splits")
    write_gen_task(tmp_path, name, 'splits = ["train", "dev"]\n')
    register_tasks([tmp_path])
    _, info = gym.make(f"memgym/{name}-v0", split="dev").reset(seed=0)
    assert "from" in info["chunk"]
    with pytest.raises(ValueError, match=r"no split 'test'; its splits are \['train', 'dev'\]"):
        gym.make(f"memgym/{name}-v0", split="test")
    assert memgym.registry.get_task("HotpotQA").splits == ("train", "test", "validation", "dev")
    (tmp_path / "Bad").mkdir()
    (tmp_path / "Bad" / "data.jsonl").write_text(json.dumps(SAMPLES[0]) + "\n")
    (tmp_path / "Bad" / "task.toml").write_text('name = "Bad"\ndata = "data.jsonl"\nsplits = ["dev"]\n')
    with pytest.raises(memgym.TaskConfigError, match="'splits': only a generated task"):
        load_task(tmp_path / "Bad")


def test_a_binary_task_toml_is_skipped_not_fatal(tmp_path):
    folder = tmp_path / "Garbage"
    folder.mkdir()
    (folder / "task.toml").write_bytes(b"\xff\xfe\x00 not toml")
    with pytest.raises(memgym.TaskConfigError, match=f"{folder / 'task.toml'}: not UTF-8 text"):
        load_task(folder)
    with pytest.warns(UserWarning, match="skipping task folder.*not UTF-8 text"):
        register_tasks([tmp_path])


def test_the_fingerprint_follows_the_folders_files(tmp_path):
    """Caches keyed by a task (the trainer's auto teacher) must notice an edited generator."""
    folder = tmp_path / "Fp"
    folder.mkdir()
    (folder / "task.toml").write_text('name = "Fp"\nversion = 0\nsource = "generator.py:make_source"\n')
    (folder / "generator.py").write_text("def make_source(split, seed):\n    return []\n")
    first = load_task(folder).fingerprint()
    assert load_task(folder).fingerprint() == first  # stable
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "generator.cpython-311.pyc").write_bytes(b"\0")
    assert load_task(folder).fingerprint() == first  # bytecode caches do not count
    (folder / "generator.py").write_text("def make_source(split, seed):\n    return [] \n")
    assert load_task(folder).fingerprint() != first


def test_a_train_table_is_read_and_leaves_the_fingerprint_as_it_was(tmp_path):
    """A task's recommended training settings do not change its samples: a teacher cached for the
    task stays valid when they are added or changed (the fingerprint is that of the file without
    them), while an edit anywhere else still changes it."""
    folder = tmp_path / "Tr"
    folder.mkdir()
    base = 'name = "Tr"\nversion = 0\nsource = "generator.py:make_source"\n\n[source_kwargs]\nhops = 1\n'
    (folder / "generator.py").write_text("def make_source(split, seed, hops=1):\n    return []\n")
    (folder / "task.toml").write_text(base)
    plain = load_task(folder)
    assert plain.train == {}
    first = plain.fingerprint()
    (folder / "task.toml").write_text(base + "\n[train]\nstudent_warmup_steps = 300  # a longer warm start\n")
    spec = load_task(folder)
    assert spec.train == {"student_warmup_steps": 300}
    assert spec.fingerprint() == first
    (folder / "task.toml").write_text(base + "\n[train]\nstudent_warmup_steps = 500\n")
    assert load_task(folder).fingerprint() == first
    (folder / "task.toml").write_text(base.replace("hops = 1", "hops = 2") + "\n[train]\nstudent_warmup_steps = 300\n")
    assert load_task(folder).fingerprint() != first


def test_a_train_value_that_is_not_a_scalar_names_its_key(tmp_path):
    folder = tmp_path / "Tr"
    folder.mkdir()
    (folder / "generator.py").write_text("def make_source(split, seed):\n    return []\n")
    (folder / "task.toml").write_text('name = "Tr"\nsource = "generator.py:make_source"\n[train]\nsteps = [1, 2]\n')
    with pytest.raises(memgym.TaskConfigError, match=r"key 'train.steps': must be a number"):
        load_task(folder)
