"""RESULTS.md, "Part 2's control: does imitation recover from a wrong memory?":
docs/data/on_policy_premise/ (examples/on_policy_premise.py)."""

from __future__ import annotations

from doctables.core import Data, f, md, table

STUDY = "on_policy_premise/results.json"


def _change(group: dict) -> str:
    if not group.get("episodes"):
        return "–"
    se = f" ± {group['loss_se']:.3f}" if group.get("loss_se") is not None else ""
    return f"{f(group['f1_clean'])} → {f(group['f1_perturbed'])} ({group['loss']:+.3f}{se}, {group['episodes']})"


@table("on_policy_premise.recovery")
def recovery(d: Data) -> str:
    """Per task and policy: F1 clean and with a distractor memory after the first chunk, on all
    episodes, and where the fact is read again (recovery possible) or not: clean → perturbed, the
    paired change ± se, and the episodes."""
    res = d(STUDY)
    rows = []
    for task, policies in res["summary"].items():
        for policy, got in policies.items():
            rows.append([task, policy, got["seeds"], f(got["f1_clean_all"]), f(got["f1_perturbed_all"]),
                         _change(got["recovery"]), _change(got["no_recovery"])])
    return md(["task", "policy", "seeds", "F1 clean", f"F1 with `{res['perturbation']}`",
               "fact read again: clean → perturbed (change ± se, episodes)",
               "fact not read again: clean → perturbed (change ± se, episodes)"], rows)


RECOVERY = "on_policy_recovery/results.json"


def _share(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


@table("on_policy_premise.comparison")
def comparison(d: Data) -> str:
    """Part 2's comparison (examples/on_policy_recovery.py): per task, the start and the teacher,
    then each arm over its seeds: clean F1 (± se over seeds), where the fact comes again clean →
    perturbed and the change (± se over seeds; each seed's), the build's minutes, and the share of
    its training calls whose memory is off the oracle's path, of those with the fact in the chunk,
    and with a wrong fact in the asked frame."""
    res = d(RECOVERY)
    rows = []
    for task, arms in res["summary"].items():
        refs = res["references"]
        states = refs.get(f"{task}/start-states") or {}
        calls = states.get("calls") or 0
        for name in ("start", "teacher"):
            got = refs.get(f"{task}/{name}")
            if got:
                shares = [_share(states[k] / calls) if name == "start" and calls else "–"
                          for k in ("off_oracle", "off_oracle_fact_in_chunk", "wrong_frame")]
                rows.append([task, f"({name})", 1, f(got["f1_clean_all"]), _change(got["recovery"]), "–", *shares])
        for arm, got in arms.items():
            se = f" ± {got['f1_clean_se']:.3f}" if got.get("f1_clean_se") is not None else ""
            loss_se = f" ± {got['loss_se']:.3f}" if got.get("loss_se") is not None else ""
            each = ", ".join(f"{x:+.3f}" for x in got["loss_by_seed"])
            change = (f"{f(got['f1_recoverable_clean'])} → {f(got['f1_recoverable_perturbed'])} "
                      f"({got['loss']:+.3f}{loss_se}; {each})")
            rows.append([task, arm, got["seeds"], f(got["f1_clean"]) + se, change, f"{got['build_min']:.0f}",
                         *[_share(got[f"{k}_share"]) for k in ("off_oracle", "off_oracle_fact_in_chunk", "wrong_frame")]])
    return md(["task", "arm", "seeds", "F1 clean (± se over seeds)",
               f"fact read again: clean → `{res['perturbation']}` (change ± se over seeds, per seed; a reference: ± se "
               "over episodes, episodes)",
               "build (min)", "training calls off the oracle's path", "… with the fact in the chunk",
               "… with a wrong fact for the asked person"], rows)
