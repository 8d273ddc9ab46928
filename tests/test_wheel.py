"""The built wheel (not an editable install) ships the built-in tasks: build it, install it into a
fresh virtual environment with only what memgym needs, and play a step from outside the repo."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What a build reads: the packages, the task folders and the packaging files.
BUILD_INPUTS = ("pyproject.toml", "README.md", "memgym", "agents", "memopd", "tasks")
CACHES = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")

CHECK = textwrap.dedent("""
    import gymnasium as gym, memgym
    from pathlib import Path
    assert "site-packages" in Path(memgym.__file__).parts, memgym.__file__
    ids = memgym.list_envs()
    assert {"memgym/LongQA-v0", "memgym/NeedleQA-v0", "memgym/HotpotQA-v0"} <= set(ids), ids
    env = gym.make("memgym/LongQA-v0")
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("my memory")
    assert info["chunk_index"] == 1 and "Question:" in obs
    print("ok", len(ids))
""")


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, **kwargs)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout}\n{out.stderr}"
    return out


@pytest.mark.slow
def test_the_wheel_ships_the_builtin_tasks(tmp_path):
    src = tmp_path / "src"  # build from a copy: an in-tree build would leave build/ in the checkout
    src.mkdir()
    for name in BUILD_INPUTS:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=CACHES)
        else:
            shutil.copy2(path, src / name)
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(dist)])
    wheel = next(dist.glob("*.whl"))
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    run([*pip, "--python", str(python), "install", "-q", "--no-deps", str(wheel)])
    # what memgym needs: the env counts its budget in tokens of its default tokenizer, read with
    # tokenizers (Rust, no torch)
    run([*pip, "--python", str(python), "install", "-q", "gymnasium", "numpy", "tokenizers"])
    elsewhere = tmp_path / "elsewhere"  # no ./tasks here, and not the repository
    elsewhere.mkdir()
    out = run([str(python), "-c", CHECK], cwd=elsewhere, env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.split()[0] == "ok"
