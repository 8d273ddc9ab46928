"""A training method of your own, as a learner plugin: weigh the answer call's distillation terms.

    python -m memopd.train --env memgym/LongQA-v0 \
        --plugin examples.answer_weight:AnswerWeight --plugin-kwarg answer_weight=4

The answer is one call of an episode's many; with the token-level distillation mean it gets the
share of its tokens. This plugin multiplies the distillation weight of every answer token by
``answer_weight`` (0: the teacher supervises the memory calls only, as ``--teacher-mask memory``
does), logs the answer's share of the distillation weight, and counts the steps it weighed in its
checkpoint state (a resumed run goes on counting).

A plugin may change three things of a step (see ``memopd.learn.plugin``): the rollout
(``wrap_rollout``), the per-token loss weights (``weigh``), and what happens at the end of a step
(``end_step``); its ``Options`` dataclass holds its options (``--plugin-kwarg KEY=VALUE``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memopd.config import Config, field
from memopd.learn.plugin import LossWeights, Plugin, StepResult, WeighContext


@dataclass
class AnswerWeightOptions(Config):
    answer_weight: float = field(2.0, help="factor on the distillation weight of every answer token",
                                 range=(0.0, None))


class AnswerWeight(Plugin):
    name = "answer_weight"
    Options = AnswerWeightOptions

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.steps = 0

    def weigh(self, weights: LossWeights, ctx: WeighContext) -> dict[str, float]:
        calls = ctx.batch.token_map[:, :2].tolist()  # (episode, invocation) of every action token
        answer = torch.tensor([ctx.episodes[e].invocations[i].role == "answer" for e, i in calls], dtype=torch.bool)
        # a change of shares, not of the loss's size: the same total weight (LossWeights)
        weights.redistribute_opd(torch.where(answer, weights.opd * self.ctx.options.answer_weight, weights.opd),
                                 ctx.world)
        total = float(weights.opd.sum())
        return {"answer_weight/opd_share": float(weights.opd[answer].sum()) / total if total else 0.0}

    def end_step(self, result: StepResult) -> dict[str, float]:
        self.steps += 1
        return {"answer_weight/steps": float(self.steps)}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))
