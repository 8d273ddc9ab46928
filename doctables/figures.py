"""The figures of the results pages that have data, each drawn from its results JSON by the study
script's own plot function (``python -m doctables --figures`` redraws them into docs/)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

from doctables.core import REPO, Data

Drawer = Callable[[Data, Path], None]
FIGURES: dict[str, Drawer] = {}


def figure(name: str) -> Callable[[Drawer], Drawer]:
    """Register the drawer of ``docs/<name>``."""
    def register(fn: Drawer) -> Drawer:
        FIGURES[name] = fn
        return fn
    return register


def script(name: str) -> ModuleType:
    """examples/<name>.py as a module (examples/ is not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve the module's annotations through it
        spec.loader.exec_module(module)
    return sys.modules[name]


@figure("fair120_curves.png")
def fair120(d: Data, path: Path) -> None:
    script("reproduce_memopd").plot(d("baselines/results-fair120-fkl.json"), path)


@figure("signal_curves.png")
def signal(d: Data, path: Path) -> None:
    script("reproduce_memopd").plot(d("baselines/results-signal-fkl.json"), path)


@figure("ppo_long_curves.png")
def ppo_long(d: Data, path: Path) -> None:
    """PPO alone at lr 2e-4 over 200 steps beside MemOPD and PPO over 40, from the same start."""
    long, sig = d("baselines/results-signal-lr2e-4-long-fkl.json"), d("baselines/results-signal-fkl.json")
    sig4 = d("baselines/results-signal-lr2e-4-fkl.json")
    both = {**long, "curves": {"PPO alone, lr 2e-4 (200 steps)": long["curves"]["ppo"],
                               "PPO + MemOPD, lr 2e-3": sig["curves"]["ppo+memopd"],
                               "PPO + MemOPD, lr 2e-4": sig4["curves"]["ppo+memopd"],
                               "PPO alone, lr 2e-3": sig["curves"]["ppo"]}}
    script("reproduce_memopd").plot(both, path)


@figure("other_tokenizer_curves.png")
def other_tokenizer(d: Data, path: Path) -> None:
    script("other_tokenizer").plot(d("other_tokenizer/results.json")["runs"], path)


@figure("other_tokenizer_old_map_curves.png")
def other_tokenizer_old_map(d: Data, path: Path) -> None:
    """The other-tokenizer arms with the map before its fix, from the same start and teachers."""
    script("other_tokenizer").plot(d("other_tokenizer/results-old-map.json")["runs"], path)


def seed_study(study: str) -> Drawer:
    def draw(d: Data, path: Path) -> None:
        res = d(f"seed_methods/{study}.json")
        script("seed_methods").plot(res["runs"], res["auc_by"], res["title"], path)
    return draw


for _study, _name in (("turnopd", "seed_methods_turnopd.png"), ("pruneopd", "seed_methods_pruneopd.png"),
                      ("fopd", "seed_methods_fopd.png"), ("fopd-sampled", "seed_methods_fopd_sampled.png")):
    figure(_name)(seed_study(_study))


def draw_all(data: Data, into: Path) -> list[Path]:
    """Draw every figure into the folder ``into``; the paths written."""
    out = []
    for name, draw in FIGURES.items():
        draw(data, into / name)
        out.append(into / name)
    return out


@figure("long_horizon_length.png")
def long_horizon(d: Data, path: Path) -> None:
    script("long_horizon").plot(d("long_horizon/results.json")["summary"], path)


@figure("on_policy_recovery.png")
def on_policy_recovery(d: Data, path: Path) -> None:
    script("on_policy_recovery").plot(d("on_policy_recovery/results.json"), path)


@figure("aligned_vs_persistent.png")
def aligned_vs_persistent(d: Data, path: Path) -> None:
    script("aligned_vs_persistent").plot(d("aligned_vs_persistent/results.json"), path)


@figure("smollm2_at_length.png")
def smollm2_at_length(d: Data, path: Path) -> None:
    script("long_horizon").plot(d("smollm2_at_length/results.json")["summary"], path)


@figure("rl_plateau_curves.png")
def rl_plateau(d: Data, path: Path) -> None:
    from doctables.rl_plateau import arm_results

    script("rl_plateau").plot(arm_results(d), path)
