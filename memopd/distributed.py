"""Several processes, one training run: ``torchrun --nproc-per-node N -m memopd.train ...``.

What each rank does in a step (see :meth:`memopd.learn.trainer.Trainer.train_step`):

1. rolls out its share of the step's questions (:func:`question_share`: a question's group of
   samples stays on one rank) with a full, unsharded copy of the student (the *rollout twin*,
   refreshed from the sharded student after every update, so every rank samples from the same
   ``policy_version``);
2. exchanges the episodes (:func:`gather_objects`: token ids and rewards, small next to the
   models), so every rank sees the whole batch: rewards, group-relative advantages and episode
   metrics are those of one process;
3. takes a share of whole episodes balanced by real tokens (:func:`assign_episodes`), packs and
   scores only those, and computes the loss with *global* normalisers (:func:`all_sum` of the
   local weight and token counts), scaled so that the data-parallel gradient average is the
   gradient of the one global loss: N ranks make the update one process makes on the same batch.

Only rank 0 logs, draws progress bars and writes files, except checkpoints: every rank writes
its own shards of a Distributed Checkpoint (:class:`ShardedState`,
:func:`memopd.checkpoint.save_sharded`). The process group comes from torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/rendezvous): gloo on CPU,
nccl on CUDA, with a timeout on every collective so that a dead rank ends the job instead of
hanging it. Without torchrun (``WORLD_SIZE`` unset or 1) nothing here changes the trainer.

Sharding: :func:`wrap` applies FSDP2 (``fully_shard`` on each decoder layer, then on the root;
bf16 compute with fp32 gradient reduction on CUDA) or DDP. Packed scoring runs the decoder stack
and then the output head outside the model's own ``forward``, so the student is wrapped in
:class:`PackedStates`, whose ``forward`` is the packed decoder pass: the FSDP2 root hooks (and
DDP's) run around it, and the root's parameters (embeddings, final norm, the tied output head)
stay gathered from its forward until the end of the backward, where the head is used.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

PARALLEL_MODES = ("fsdp", "ddp")


class DistributedError(RuntimeError):
    """A multi-process run cannot go on as set up; the message says what to change."""


@dataclass(frozen=True)
class World:
    """This process's place in the run: rank ``rank`` of ``size`` (``local_rank`` on its node)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = World()


def launched_size() -> int:
    """The world size torchrun (or srun with the same variables) asked for; 1 without it."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def launched_rank() -> int:
    """This process's rank as torchrun set it (0 without torchrun), readable before :func:`setup`."""
    return int(os.environ.get("RANK", "0") or 0)


def restarted() -> bool:
    """Whether torchrun (``--max-restarts``) started these ranks again after a failure."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def setup(device: str, timeout_s: float) -> World:
    """Join the process group torchrun described in the environment (nothing for one process).

    gloo on CPU, nccl on CUDA; ``timeout_s`` bounds every collective, so a killed rank ends the
    others with an error instead of a hang."""
    if launched_size() <= 1:
        return SINGLE
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=_attempt_store(timeout), rank=launched_rank(),
                                world_size=launched_size(), timeout=timeout)
    world = World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    if device.startswith("cuda"):  # "cuda" then means this rank's own GPU everywhere
        torch.cuda.set_device(world.local_rank)
    return world


def _attempt_store(timeout: timedelta) -> dist.Store:
    """The rendezvous key-value store (``MASTER_ADDR:MASTER_PORT``), its keys prefixed by the
    torchrun restart count: after a restart a rank must never read the address a dead rank of the
    previous attempt published (measured: gloo then fails to connect to that address)."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    store = dist.TCPStore(addr, port, launched_size(), is_master=not agent and launched_rank() == 0,
                          timeout=timeout)
    return dist.PrefixStore(f"memopd/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def shutdown() -> None:
    """Leave the process group a multi-rank launch made. A single process leaves alone a group
    that something else created (an in-process vLLM engine makes one and tears it down itself)."""
    if launched_size() > 1 and dist.is_initialized():
        if dist.get_backend() == "gloo":
            # A rank that tears its group down while another still sends to it makes gloo abort the
            # other (std::terminate, seen about 1 run in 7 of a two-rank test); meet first. Bounded,
            # so a rank left alone by a peer that failed does not wait for the run's timeout.
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
            except RuntimeError:
                pass
        dist.destroy_process_group()


def check_batch(world: World, questions_per_step: int, group_size: int) -> None:
    """Every rank needs at least one episode a step (it must take part in every update)."""
    if world.enabled and questions_per_step * group_size < world.size:
        raise DistributedError(
            f"{questions_per_step} questions x {group_size} samples = {questions_per_step * group_size} episodes "
            f"a step cannot feed {world.size} ranks; raise --questions-per-step to at least "
            f"{math.ceil(world.size / group_size)} (ideally a multiple of {world.size})")


# ------------------------------------------------------------------------------------------------
# Collectives on plain numbers and objects
# ------------------------------------------------------------------------------------------------

def _reduce(values: Sequence[float], op: Any, world: World) -> list[float]:
    if not world.enabled:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op)
    return t.cpu().tolist()


def all_sum(values: Sequence[float], world: World) -> list[float]:
    """Element-wise sum over ranks (float64)."""
    return _reduce(values, dist.ReduceOp.SUM, world)


def all_max(values: Sequence[float], world: World) -> list[float]:
    return _reduce(values, dist.ReduceOp.MAX, world)


def all_min(values: Sequence[float], world: World) -> list[float]:
    return _reduce(values, dist.ReduceOp.MIN, world)


def all_sum_tensor(t: torch.Tensor, world: World) -> torch.Tensor:
    """A tensor summed over ranks (a new tensor; the input is left as it is)."""
    if not world.enabled:
        return t.clone()
    out = t.detach().clone()
    dist.all_reduce(out.cuda() if dist.get_backend() == "nccl" else out)
    return out


def gather_objects(obj: Any, world: World) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if not world.enabled:
        return [obj]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def from_rank0(obj: Any, world: World) -> Any:
    """Rank 0's ``obj`` on every rank (picklable)."""
    if not world.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World) -> None:
    if world.enabled:
        dist.barrier()


# ------------------------------------------------------------------------------------------------
# Who does what
# ------------------------------------------------------------------------------------------------

def question_share(num_questions: int, world: World) -> tuple[int, int]:
    """(first question, how many) of this rank's contiguous share of a step's questions; shares
    differ by at most one question."""
    base, extra = divmod(num_questions, world.size)
    first = world.rank * base + min(world.rank, extra)
    return first, base + (1 if world.rank < extra else 0)


def assign_episodes(token_counts: Sequence[int], world_size: int) -> list[list[int]]:
    """Whole episodes to ranks, balanced by real tokens: largest first to the least loaded rank
    (ties to the lower rank). Deterministic, so every rank computes the same assignment. Each
    rank's list is in episode order."""
    if len(token_counts) < world_size:
        raise DistributedError(f"{len(token_counts)} episodes cannot be shared by {world_size} ranks")
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    # the first world_size episodes land one on each rank (empty ranks have the smallest load)
    for i in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], len(shares[r]), r))
        shares[r].append(i)
        loads[r] += token_counts[i]
    return [sorted(s) for s in shares]


def episode_tokens(episode: Any) -> int:
    """Real tokens an episode's invocations put into packed rows (prompt + response each)."""
    return sum(len(inv.prompt_ids) + len(inv.response_ids) for inv in episode.invocations)


def gather_episodes(mine: list[Any], world: World) -> list[Any]:
    """Every rank's episodes, in rank order, on every rank (one process: its own)."""
    if not world.enabled:
        return mine
    return [e for part in gather_objects(mine, world) for e in part]


def own_episodes(episodes: Sequence[Any], world: World) -> list[int]:
    """Indices of the episodes this rank packs and scores: all of them alone; under torchrun a
    share of whole episodes balanced by real tokens."""
    if not world.enabled:
        return list(range(len(episodes)))
    return assign_episodes([episode_tokens(e) for e in episodes], world.size)[world.rank]


# ------------------------------------------------------------------------------------------------
# A global loss from each rank's share
# ------------------------------------------------------------------------------------------------

def standardise(x: torch.Tensor, world: World) -> torch.Tensor:
    """``x`` to mean 0, std 1 over every rank's values (one process: in ``x``'s own dtype)."""
    if not world.enabled:
        return (x - x.mean()) / (x.std() + 1e-6) if len(x) > 1 else x
    n, total = all_sum([len(x), float(x.double().sum())], world)
    if n <= 1:
        return x
    mean = total / n
    (sq,) = all_sum([float(((x.double() - mean) ** 2).sum())], world)
    return ((x - mean) / (math.sqrt(sq / (n - 1)) + 1e-6)).float()


def row_groups(batch: Any, minibatches: int, world: World) -> list[Any]:
    """``minibatches`` groups of a packed batch's rows. Under torchrun every rank makes the same
    number (its rows in that many near-equal parts; fewer when a rank has fewer rows), since each
    group is one collective optimizer step."""
    if not world.enabled:
        return batch.micro_batches(max(1, math.ceil(batch.num_rows / minibatches)))
    (m,) = all_min([min(minibatches, batch.num_rows)], world)
    size, extra = divmod(batch.num_rows, int(m))
    bounds = [i * size + min(i, extra) for i in range(int(m) + 1)]
    return [batch.select_rows(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def global_scales(sums: Sequence[float], world: World) -> list[float]:
    """Factors turning this rank's masked means (over its own normalisers ``sums``) into its part of
    the means over every rank: 1 for one process."""
    totals = all_sum(sums, world)
    return [(s / g if g > 0 else 0.0) for s, g in zip(sums, totals)]


def any_rank(flag: bool, world: World) -> bool:
    """A flag raised on any rank (a non-finite loss skips the minibatch everywhere)."""
    return bool(flag) if not world.enabled else all_max([float(bool(flag))], world)[0] > 0


def clip_gradients(params: Iterable[torch.nn.Parameter], max_norm: float, world: World) -> torch.Tensor:
    """Clip the gradient norm (of the whole gradient, also when it is sharded) to ``max_norm``."""
    if not world.enabled:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return clip_grad_norm(params, max_norm, world)


# ------------------------------------------------------------------------------------------------
# Sharding
# ------------------------------------------------------------------------------------------------

class PackedStates(torch.nn.Module):
    """The packed decoder pass of a causal LM as one module call: ``forward(batch, lowering)`` is
    :func:`memopd.attention.packed_hidden_states` of ``lm``. Wrapping this module (not the LM)
    makes FSDP2's root hooks and DDP's gradient sync run around the pass the trainer makes."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, batch: Any, lowering: str | None = None) -> torch.Tensor:
        from memopd.attention import packed_hidden_states

        return packed_hidden_states(self.lm, batch, lowering)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks of a causal LM (its base model's ``layers``), FSDP2's sharding units."""
    from memopd.attention import base_model

    layers = getattr(base_model(model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise DistributedError(f"{type(model).__name__}: no decoder layer list (base_model.layers) to shard; "
                               "use --parallel ddp")
    return list(layers)


def wrap(module: torch.nn.Module, layers: Iterable[torch.nn.Module], mode: str, device: str,
         world: World) -> torch.nn.Module:
    """``module`` made data-parallel over the world; returns what to call for its forward.

    fsdp: ``fully_shard`` on each of ``layers``, then on ``module`` (the root), in place: the
    module's parameters become shards (DTensors) and the returned module is ``module`` itself.
    On CUDA the compute is bf16 and gradients are reduced in fp32. ddp: a
    ``DistributedDataParallel`` around ``module`` (parameters stay whole)."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [torch.cuda.current_device()] if device.startswith("cuda") else None  # setup() chose it
        return DistributedDataParallel(module, device_ids=ids)
    if mode != "fsdp":
        raise DistributedError(f"unknown --parallel {mode!r}; choose one of {PARALLEL_MODES}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kind = torch.device(device).type
    mesh = init_device_mesh(kind, (world.size,))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if kind == "cuda" else MixedPrecisionPolicy())
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(module, mesh=mesh, mp_policy=mp)
    return module


def whole_head(head: Any) -> Any:
    """A copy of a model's output head (:class:`memopd.heads.OutputHead`) with its own whole
    weights, taken before the model is sharded: a sharded teacher's head is applied to its
    gathered states long after its forward (in every KL chunk of every minibatch)."""
    import copy
    import dataclasses

    return dataclasses.replace(head, lm_head=copy.deepcopy(head.lm_head).requires_grad_(False))


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, world: World) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over sharded or whole gradients: the norm of the full
    gradient (squares of the local shards summed over ranks), and every gradient scaled by
    ``min(1, max_norm / (norm + 1e-6))`` as torch does."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    sq = torch.stack([_local(g).detach().float().pow(2).sum() for g in grads]).sum()
    if world.enabled and any(_is_dtensor(g) for g in grads):
        sq = all_sum_tensor(sq, world).to(sq.device)
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        _local(g).mul_(coef.to(_local(g).device, _local(g).dtype))
    return total


# ------------------------------------------------------------------------------------------------
# Full weights from shards and back (rollout twin, checkpoints)
# ------------------------------------------------------------------------------------------------

def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state with every shard gathered: plain CPU tensors, on every rank (a
    collective: every rank must call it, in the same order)."""
    out = {}
    for k, v in module.state_dict().items():
        full = v.full_tensor() if _is_dtensor(v) else v
        out[k] = full.detach().to("cpu", copy=True)
    return out


def load_full_state_dict(module: torch.nn.Module, state: Mapping[str, torch.Tensor],
                         strict: bool = True) -> tuple[list[str], list[str]]:
    """Copy whole tensors into ``module``, each rank keeping its own shard of a sharded parameter
    (FSDP2 shards dim 0 as ``torch.chunk`` does). No communication. Returns (missing,
    unexpected) keys like ``load_state_dict(strict=False)``."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if strict and (missing or unexpected):
        raise DistributedError(f"state does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    with torch.no_grad():
        for k, dst in own.items():
            if k in state:
                _copy_into(dst, state[k], k)
    return missing, unexpected


def _copy_into(dst: torch.Tensor, full: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(full.shape):
        raise RuntimeError(f"Error(s) in loading state_dict:\n\tsize mismatch for {name}: copying a param with "
                           f"shape {tuple(full.shape)}, the model's is {tuple(dst.shape)}")
    local = _local(dst)
    if _is_dtensor(dst):
        mesh = dst.device_mesh
        chunks = torch.chunk(full, mesh.size(), dim=0)
        rank = mesh.get_local_rank()
        full = chunks[rank] if rank < len(chunks) else full[:0]
    local.copy_(full.to(local.device, local.dtype))


class FullState:
    """A sharded module as :func:`memopd.checkpoint.load_latest` reads a one-process checkpoint
    into it: ``load_state_dict`` takes whole tensors and keeps this rank's shards (so a run made by
    one process continues under torchrun)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True):
        return load_full_state_dict(self.module, state, strict=strict)


def load_full_optimizer_state(opt: torch.optim.Optimizer, sd: Mapping[str, Any]) -> None:
    """Load a whole-tensor optimizer state (as one process writes it: parameters by index in the
    optimizer's order), each rank keeping the shard of its parameters."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for i, s in sd["state"].items():
        p = params[int(i)]
        state[i] = {k: _shard_like(p, v) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                    for k, v in s.items()}
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def _shard_like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    if not _is_dtensor(param):
        return full
    from torch.distributed.tensor import DTensor

    local = torch.empty_like(param.to_local())
    chunks = torch.chunk(full, param.device_mesh.size(), dim=0)
    rank = param.device_mesh.get_local_rank()
    local.copy_((chunks[rank] if rank < len(chunks) else full[:0]).to(local.device, local.dtype))
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride())


def sync_twin(sharded: torch.nn.Module, twin: torch.nn.Module) -> None:
    """Refresh the rollout twin (a whole copy of the student) from the sharded student. For DDP
    the twin *is* the student's module and nothing is copied."""
    if sharded is twin:
        return
    load_full_state_dict(twin, full_state_dict(sharded))


def publish_twin(twin: torch.nn.Module, sharded: torch.nn.Module, world: World) -> None:
    """After the twin was changed in place on every rank (the warm start): rank 0's weights go to
    every rank's twin and into the (sharded) student, so all ranks hold one model."""
    if not world.enabled:
        return
    with torch.no_grad():
        for t in twin.state_dict().values():
            dist.broadcast(t, src=0)
    if sharded is not twin:
        load_full_state_dict(sharded, twin.state_dict())


# ------------------------------------------------------------------------------------------------
# Sharded state for Distributed Checkpoint
# ------------------------------------------------------------------------------------------------

class ShardedState:
    """What a Distributed Checkpoint (``torch.distributed.checkpoint``) of a run holds: each
    model's and each optimizer's state as this rank's shards (DTensors under FSDP2, whole tensors
    otherwise), keyed by parameter names, not by rank or position. DCP saves every rank's shards
    in parallel and reshards on load, so a checkpoint written by N ranks loads into M ranks, or
    into one process (no process group: then every tensor is read whole).

    ``models`` maps a name to a module; ``optimizers`` maps a name to (the module whose
    ``parameters()`` it optimizes, the optimizer). Use as DCP does: ``sd = state.state_dict()``,
    ``dcp.load(sd, ...)``, ``state.load_state_dict(sd)``."""

    def __init__(self, models: Mapping[str, torch.nn.Module],
                 optimizers: Mapping[str, tuple[torch.nn.Module, torch.optim.Optimizer]], trainable_only: bool = False):
        self.models, self.optimizers = dict(models), dict(optimizers)
        self.trainable_only = trainable_only  # LoRA: the frozen base is rebuilt from --model, not saved

    def state_dict(self, optimizers: Iterable[str] | None = None) -> dict[str, Any]:
        """Models and the ``optimizers`` named (default: those holding state). An optimizer that has
        not stepped yet has nothing to save, and asking torch for its state would make one by
        stepping it once with zero gradients (its step count then runs one ahead of a run that
        never saved): name it only to load saved state into it."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        names = [k for k, (_, o) in self.optimizers.items() if o.state] if optimizers is None else list(optimizers)
        out: dict[str, Any] = {k: get_model_state_dict(m, options=self._options()) for k, m in self.models.items()}
        out.update({k: get_optimizer_state_dict(*self.optimizers[k]) for k in names})
        return out

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=True, strict=False) if self.trainable_only else None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        for k, m in self.models.items():
            set_model_state_dict(m, state[k], options=self._options())
        for k, (m, o) in self.optimizers.items():
            if k in state:
                set_optimizer_state_dict(m, o, state[k])


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------

def weighted_stats(parts: dict[str, list[tuple[float, float]]], world: World) -> dict[str, float]:
    """Means over ranks and minibatches: ``parts[name]`` lists (sum, count) pairs of this rank;
    the result is sum over all ranks / count over all ranks (NaN where nothing was counted)."""
    names = sorted(parts)
    flat = [x for n in names for x in (sum(s for s, _ in parts[n]), sum(c for _, c in parts[n]))]
    totals = all_sum(flat, world)
    out = {}
    for j, n in enumerate(names):
        s, c = totals[2 * j], totals[2 * j + 1]
        out[n] = s / c if c > 0 else float("nan")
    return out


__all__ = ["PARALLEL_MODES", "DistributedError", "FullState", "PackedStates", "SINGLE", "ShardedState", "World", "all_max",
           "all_min", "all_sum", "all_sum_tensor", "any_rank", "assign_episodes", "barrier", "check_batch", "clip_grad_norm",
           "clip_gradients", "decoder_layers", "episode_tokens", "full_state_dict", "gather_episodes", "gather_objects",
           "global_scales", "own_episodes", "row_groups", "standardise",
           "from_rank0", "launched_rank", "launched_size", "load_full_optimizer_state", "load_full_state_dict",
           "publish_twin", "question_share", "restarted", "setup", "shutdown", "sync_twin", "weighted_stats", "whole_head",
           "wrap"]
