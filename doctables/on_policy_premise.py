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
