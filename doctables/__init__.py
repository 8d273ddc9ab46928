"""The tables of the results pages (docs/RESULTS.md, docs/BENCHMARKS.md), rebuilt from the results
JSON committed in docs/data/.

A table on a page is either rebuilt from data or says it has none, on the line before it:

    <!-- table: baselines.fair120 -->     rebuilt by the renderer registered as "baselines.fair120"
    <!-- table: none -->                  measured, but its data was not kept (the section says so in
                                          words: "figure only, data not kept")
    <!-- table: setting -->               describes a setting (task, models, budget, flags), no result

A new study's section follows the pattern:

1. its script writes a results JSON; commit it under ``docs/data/<study>/``;
2. write one small renderer per table in ``doctables/<study>.py``: a function of the data that
   returns the table's markdown, registered with ``@table("<study>.<name>")``; add the module to
   ``MODULES`` below;
3. put ``<!-- table: <study>.<name> -->`` on the line before the table and run
   ``python -m doctables --write`` to write the table from the data;
4. ``python -m doctables`` (and ``tests/test_results_tables.py``) fails whenever a page and its
   data differ, and whenever a renderer's output does not move when its data does.
"""

from __future__ import annotations

import importlib

from doctables.core import TABLES, Data, table  # noqa: F401

MODULES = ("baselines", "reproduction", "seed_methods", "smollm2", "other_tokenizer", "benchmarks", "summary",
           "length_axis", "long_inputs", "memory_binds", "ppo_collapse", "multi_teacher", "long_horizon",
           "rl_plateau", "on_policy_premise")
"""The renderer modules, each the tables of one study (or one page's benchmarks)."""


def load_all() -> dict:
    """Import every renderer module (they register their tables); the registry."""
    for name in MODULES:
        importlib.import_module(f"doctables.{name}")
    return TABLES
