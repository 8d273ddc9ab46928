"""The student in its distributed world, behind one object.

In one process the student is one module: rollouts sample it, the update differentiates it, a
checkpoint saves it. Under torchrun (:mod:`memopd.distributed`) it is sharded (FSDP2) or replicated
(DDP) for the update, with a twin of whole weights for rollouts, evaluations and audits, kept in
step after every update; the critic (GAE) is wrapped alike. :class:`Student` holds these forms and
answers for them: :meth:`Student.states` (the update's forward), :meth:`Student.sync` (the twin
after an update), the checkpoint's views of the models (:meth:`Student.modules`, whole or sharded)
and the export of the final model. Everything else of the learner reads one of them and never
asks which world it is in.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from agents.run_layout import RUN_ADAPTER_DIR, RUN_MODEL_DIR
from memopd import distributed
from memopd.config import ConfigError
from memopd.learn.models import Critic
from memopd.lora import checkpoint_view, lora_on
from memopd.packing import PackedBatch
from memopd.scoring import ActionStates, action_states

if TYPE_CHECKING:  # the run's options, for the annotations
    from memopd.learn.options import CoreConfig


def join_world(cfg: CoreConfig, log: Callable[[str], None]) -> tuple[distributed.World, Any, Callable[[str], None]]:
    """This process's place in the run: the world (:data:`memopd.distributed.SINGLE` alone; under
    torchrun the process group, joined), checked against the run's batch and backend; on ranks
    other than 0, a config without progress bars and a log that says nothing."""
    world = distributed.setup(cfg.device, cfg.dist_timeout)  # one process: nothing to join
    distributed.check_batch(world, cfg.questions_per_step, cfg.group_size)
    if world.enabled and cfg.backend != "hf":
        distributed.shutdown()
        raise ConfigError(f"--backend {cfg.backend} runs in one process only in this version; under torchrun "
                          "use --backend hf (each rank samples with a whole copy of the student)")
    if world.is_main:
        return world, cfg, log
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' own bars (loading weights)
    return world, dataclasses.replace(cfg, progress=False), _quiet


def _quiet(message: str) -> None:
    """The log of ranks other than 0."""


class Student:
    """The trained model (``model``), the whole-weight one that rollouts sample (``twin``: the
    model itself in one process), the critic with GAE, and the ``--ref-beta`` reference."""

    def __init__(self, cfg: CoreConfig, world: distributed.World, model: torch.nn.Module):
        self.cfg, self.world, self.model = cfg, world, model
        self.critic = Critic(model) if cfg.advantage == "gae" else None
        self.ref: torch.nn.Module | None = None
        self.forward, self.critic_forward, self.head = None, self.critic, None
        self.twin = self._go_parallel()

    def _go_parallel(self) -> torch.nn.Module:
        """Under torchrun, shard (FSDP2) or replicate (DDP) the student and the critic; returns the
        model with whole weights. Alone: the student."""
        from memopd.heads import output_head

        if not self.world.enabled:
            return self.model
        cfg, world = self.cfg, self.world
        self.head = output_head(self.model)  # probed through the model's own forward, before sharding
        twin = copy.deepcopy(self.model) if cfg.parallel == "fsdp" else self.model
        self.forward = distributed.wrap(distributed.PackedStates(self.model), distributed.decoder_layers(self.model),
                                        cfg.parallel, cfg.device, world)
        if self.critic is not None:
            self.critic_forward = distributed.wrap(self.critic, distributed.decoder_layers(self.critic.lm),
                                                   cfg.parallel, cfg.device, world)
        return twin

    def states(self, mb: PackedBatch) -> ActionStates:
        """The student's states at a minibatch's action tokens (through the FSDP2/DDP wrapper under
        torchrun, so that gradients are reduced across ranks)."""
        if self.forward is None:
            return action_states(self.model, mb, lowering=self.cfg.attn)
        hidden = self.forward(mb, self.cfg.attn)
        return ActionStates(hidden, self.head, mb.temperatures.to(hidden.device))

    def sync(self) -> None:
        """The twin takes the updated weights (nothing to do in one process)."""
        distributed.sync_twin(self.model, self.twin)

    def publish(self) -> None:
        """After the twin changed in place on every rank (the warm start): rank 0's weights go to
        every rank and into the trained model."""
        distributed.publish_twin(self.twin, self.model, self.world)

    def make_ref(self) -> None:
        """The ``--ref-beta`` reference: a frozen copy of the student as it starts; with LoRA the
        student itself, read with its adapters off (the base model: no second copy, nothing to
        checkpoint)."""
        if self.cfg.ref_beta <= 0:
            return
        self.ref = self.twin if lora_on(self.cfg) else copy.deepcopy(self.twin).requires_grad_(False)

    # -- checkpoints and export ------------------------------------------------------------------
    def modules(self) -> dict[str, Any]:
        """What a checkpoint keeps: the models, each as its trainable tensors only under LoRA."""
        mods = {"student": checkpoint_view(self.model)}
        if self.critic is not None:
            mods["critic"] = checkpoint_view(self.critic)
        if self.ref is not None and not lora_on(self.cfg):
            mods["ref"] = self.ref
        return mods

    def whole_modules(self) -> dict[str, Any]:
        """The models as a one-process checkpoint loads them (a sharded one seen whole)."""
        return {k: distributed.FullState(m) if self.world.enabled and k != "ref" else m
                for k, m in self.modules().items()}

    def sharded_state(self, optimizers: dict[str, tuple[Any, Any]]) -> distributed.ShardedState:
        """The models and ``optimizers`` as Distributed Checkpoint saves and loads them."""
        models = {k: getattr(m, "module", m) for k, m in self.modules().items()}
        return distributed.ShardedState(models, optimizers, trainable_only=lora_on(self.cfg))

    def export(self, run_dir: Path, tokenizer: Any) -> Path:
        """The student as a standard transformers directory (weights + tokenizer), ``RUN_DIR/model``
        (under torchrun the whole weights, as the rollouts use them); with LoRA the merged model,
        and the adapter directory in ``RUN_DIR/adapter``."""
        from agents.models import save_pretrained

        if not lora_on(self.cfg):
            return save_pretrained(run_dir / RUN_MODEL_DIR, self.twin, tokenizer)
        from agents.lora import AdapterWriter, merged_copy

        save_pretrained(run_dir / RUN_ADAPTER_DIR, AdapterWriter(self.twin), tokenizer)
        return save_pretrained(run_dir / RUN_MODEL_DIR, merged_copy(self.twin), tokenizer)


__all__ = ["Student", "join_world"]
