"""A teacher per env and per call role: the routing table of ``--teacher KEY=SPEC``.

    --teacher memory=http://host:8000/v1 --teacher answer=path/to/reader --teacher LongQA-v0:*=tiny-teacher

A route's KEY is ``ENV:ROLE`` (an env tag of the run, :mod:`memopd.learn.mix`, or ``*``; a role,
``memory`` or ``answer``, or ``*``), with the short forms ``memory`` / ``answer`` (``*:ROLE``), ``ENV``
(``ENV:*``) and ``*``; SPEC is any teacher ``--teacher`` takes (a local model, a URL, one of another
tokenizer, ``auto``: the env's own auto teacher). A call goes to the most specific route that matches
its episode's env and its role: ``ENV:ROLE``, then ``ENV:*``, then ``*:ROLE``, then ``*``. A call no
route matches is unsupervised (its tokens leave the teacher mask). A plain ``--teacher SPEC`` alone is
the single teacher of before; a run of several envs with ``--teacher auto`` and no routes routes each
env to its own auto teacher (``ENV=auto`` for each).

Every route's teacher is checked at start against what the run reads of it (the estimator, the
context, the plugins: :func:`memopd.learn.needs.check_needs`, one ``error:`` line naming the route).
Each step, :class:`RoutedTeacher` packs each route's calls apart (each call in the exact state the
student sampled it in: its own prompt, positions and visibility) and asks that route's teacher for
them; the served teachers' requests run in threads while the local teachers score in this thread.
The scores are put back in the batch's action order as what the estimator reads: the full
log-distribution (``distribution``), the top-k (``topk``) or the sampled tokens' log-probs
(``sampled``). Metrics: ``teacher/ROUTE/supervised_share`` (the share of the step's action tokens
each route supervises), ``teacher/unrouted_share``, and each teacher's own metrics as
``teacher/ROUTE/...``.
"""

from __future__ import annotations

import dataclasses
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from agents.records import ROLES, Episode
from memopd import losses
from memopd.config import ConfigError
from memopd.learn.estimators.base import TeacherScores, TopK
from memopd.learn.teachers.base import Teacher
from memopd.packing import PackedBatch, pack_episodes

# CoreConfig (memopd.learn.options) names the run's core options in the annotations; it is not imported,
# even for type checkers, because options imports this module (an import cycle otherwise).

ANY = "*"
_KEY = re.compile(r"^(?:[A-Za-z0-9_.*-]+)(?::(?:memory|answer|\*))?$")


@dataclass(frozen=True)
class Route:
    """One row of the routing table: the calls of env ``env`` (a tag, or ``*``) and role ``role``
    (``memory``, ``answer`` or ``*``) go to the teacher ``spec``."""

    env: str
    role: str
    spec: str

    @property
    def key(self) -> str:
        """As ``--teacher KEY=SPEC`` writes it."""
        return f"{self.env}:{self.role}"

    @property
    def label(self) -> str:
        """Its name in metrics: ``memory``, ``LongQA-v0``, ``LongQA-v0:answer``, ``default`` (``*``)."""
        if self.env == ANY:
            return "default" if self.role == ANY else self.role
        return self.env if self.role == ANY else f"{self.env}:{self.role}"

    def text(self) -> str:
        """``KEY=SPEC`` in its short form (``memory=...``, ``LongQA-v0=...``, ``*=...``)."""
        return f"{ANY if self.label == 'default' else self.label}={self.spec}"


def is_route(value: str) -> bool:
    """Whether a ``--teacher`` value is ``KEY=SPEC`` (a route), not a plain spec: the part before the
    first ``=`` is a route key (no ``/``: a path or a URL is a spec)."""
    key, sep, spec = value.partition("=")
    return bool(sep and spec) and "/" not in key and bool(_KEY.match(key.strip()))


def parse_route(value: str, tags: Sequence[str]) -> Route:
    """``KEY=SPEC`` (or a plain SPEC: ``*``) as a :class:`Route`, its env one of the run's ``tags``."""
    if not is_route(value):
        return Route(ANY, ANY, value)
    key, _, spec = value.partition("=")
    env, _, role = key.strip().partition(":")
    if not role and env in ROLES:
        env, role = ANY, env
    role = role or ANY
    if env != ANY and env not in tags:
        raise ConfigError(f"--teacher {value}: {env!r} is not an env of this run (its envs: {', '.join(tags)}; "
                          "or memory=, answer=, *=)")
    return Route(env, role, spec.strip())


def parse_routes(values: Sequence[str], tags: Sequence[str]) -> list[Route]:
    """The routing table, each key once."""
    routes = [parse_route(v, tags) for v in values]
    keys = [r.key for r in routes]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ConfigError(f"--teacher: the route {twice[0]} is given twice; give each route once")
    return routes


def teacher_flags(argv: Sequence[str]) -> list[str]:
    """``--teacher KEY=SPEC`` is a route: with any route on the command line every ``--teacher``
    becomes ``--teacher-routes`` (a plain SPEC among routes is the ``*`` route). Without a route
    ``--teacher`` is left as is."""
    argv = list(argv)
    at = [i + 1 for i, a in enumerate(argv[:-1]) if a == "--teacher"]
    if not any(is_route(argv[i]) for i in at):
        return argv
    return ["--teacher-routes" if i + 1 in at else a for i, a in enumerate(argv)]


def route_table(cfg: CoreConfig) -> list[Route]:
    """The run's routes: ``--teacher-routes``; a mix with ``--teacher auto`` and no route: each env to
    its own auto teacher; else none (the single ``--teacher``)."""
    from memopd.learn.mix import env_mix

    tags = [s.tag for s in env_mix(cfg)]
    if cfg.teacher_routes:
        return parse_routes(cfg.teacher_routes, tags)
    if cfg.env_mix and cfg.teacher == "auto":
        return [Route(t, ANY, "auto") for t in tags]
    return []


def pick(routes: Sequence[Route], env: str, role: str) -> int | None:
    """The index of the route of a call of env ``env`` and role ``role`` (None: no route)."""
    for want in ((env, role), (env, ANY), (ANY, role), (ANY, ANY)):
        for i, r in enumerate(routes):
            if (r.env, r.role) == want:
                return i
    return None


def call_routes(routes: Sequence[Route], episodes: Sequence[Episode], tags: dict[str, str]) -> list[list[int | None]]:
    """The route of every call of ``episodes`` (``tags``: an episode's ``task_id`` -> its env tag)."""
    return [[pick(routes, tags.get(e.task_id, ""), inv.role) for inv in e.invocations] for e in episodes]


@dataclass
class RouteBatch:
    """A route's calls of a step, packed apart: its episodes (each the calls of one episode that
    go to this route), its batch, and where each of its actions is in the step's batch."""

    episodes: list[Episode]
    batch: PackedBatch
    index: torch.Tensor  # [n] long


def split_batch(batch: PackedBatch, episodes: Sequence[Episode], routes: list[list[int | None]], n_routes: int,
                pack: Callable[[list[Episode]], PackedBatch]) -> list[RouteBatch | None]:
    """Each route's calls of ``batch`` (the packed ``episodes``), packed by ``pack``; None for a
    route with no call this step."""
    where = {tuple(k): n for n, k in enumerate(batch.token_map.tolist())}
    out: list[RouteBatch | None] = []
    for r in range(n_routes):
        subs, origin = [], []
        for e, ep in enumerate(episodes):
            calls = [i for i, got in enumerate(routes[e]) if got == r]
            if calls:
                subs.append(dataclasses.replace(ep, invocations=[ep.invocations[i] for i in calls]))
                origin.append((e, calls))
        if not subs:
            out.append(None)
            continue
        sub = pack(subs)
        index = [where[(origin[e][0], origin[e][1][i], t)] for e, i, t in sub.token_map.tolist()]
        out.append(RouteBatch(subs, sub, torch.tensor(index, dtype=torch.long)))
    return out


class RoutedTeacher(Teacher):
    """The teachers of a routing table, as one teacher of the step (see the module doc)."""

    provides = frozenset({"distribution", "topk", "sampled"})
    lacks = {"persistent": "a routing table scores each call in its own state (each route's calls packed apart)",
             "sharded": "a routing table's teachers are not sharded in this version"}
    instead = "one --teacher"

    def __init__(self, routes: Sequence[Route], teachers: Sequence[Teacher], tags: dict[str, str], *,
                 reads: frozenset[str], topk: int, chunk: int | None, pack_tokens: int, roles: Sequence[str],
                 pad_token_id: int):
        self.routes, self.teachers, self.tags = list(routes), list(teachers), tags
        self.reads, self.k, self.chunk = reads, topk, chunk or 1024
        self.pack_tokens, self.roles, self.pad = pack_tokens, tuple(roles), pad_token_id

    def _pack(self, episodes: list[Episode]) -> PackedBatch:
        return pack_episodes(episodes, self.pack_tokens, mode="aligned", teacher_roles=self.roles,
                             pad_token_id=self.pad)

    def route_batches(self, episodes: Sequence[Episode], batch: PackedBatch) -> list[RouteBatch | None]:
        """Each route's calls of the step, packed apart (what its teacher is asked)."""
        return split_batch(batch, episodes, call_routes(self.routes, episodes, self.tags), len(self.routes),
                           self._pack)

    @torch.no_grad()
    def score(self, episodes: Sequence[Episode], batch: PackedBatch) -> TeacherScores:
        """Every route's teacher on its calls (served ones in threads, local ones here), put back in
        ``batch``'s action order. The actions of calls with no route leave ``batch.teacher``."""
        parts = self.route_batches(episodes, batch)
        remote = [r for r, p in enumerate(parts) if p is not None and self.teachers[r].model is None]
        got: dict[int, TeacherScores] = {}
        with ThreadPoolExecutor(max(1, len(remote))) as pool:
            futures = {r: pool.submit(self.teachers[r].score, parts[r].episodes, parts[r].batch) for r in remote}
            for r, p in enumerate(parts):  # the local teachers while the served ones wait on their servers
                if p is not None and r not in futures:
                    got[r] = self.teachers[r].score(p.episodes, p.batch)
            got.update({r: f.result() for r, f in futures.items()})
        return self._merge(batch, parts, got)

    def _merge(self, batch: PackedBatch, parts: list[RouteBatch | None], got: dict[int, TeacherScores]) -> TeacherScores:
        n = batch.num_actions
        routed = torch.zeros(n, dtype=torch.bool)
        supervised = torch.zeros(n, dtype=torch.bool)
        logp: torch.Tensor | None = None  # [n, V] once the first route's width is known
        filler = float(torch.log(torch.tensor(1.0 / (self.k + 1)))) if self.k else 0.0
        top_ids = torch.arange(self.k).repeat(n, 1) if "topk" in self.reads else None
        top_logp = torch.full((n, self.k), filler) if "topk" in self.reads else None
        sampled = torch.zeros(n) if "sampled" in self.reads else None
        project, metrics = None, {}
        for r, part in enumerate(parts):
            if part is None:
                metrics[f"teacher/{self.routes[r].label}/supervised_share"] = 0.0
                continue
            s, idx, targets = got[r], part.index, part.batch.action_ids
            routed[idx] = True
            supervised[idx] = True if s.supervised is None else s.supervised.bool()
            if "distribution" in self.reads:
                mine = s.logp if s.logp is not None else losses.teacher_logprobs(s.states, self.chunk)
                if logp is None:  # a call with no route gets a uniform target (it is not supervised)
                    logp = torch.full((n, mine.shape[-1]), -float(torch.log(torch.tensor(float(mine.shape[-1])))))
                logp[idx] = mine.float()
            if top_ids is not None:
                top = s.topk(self.k, targets, self.chunk)
                top_ids[idx], top_logp[idx] = top.ids, top.logp.float()
                project = top.project if top.project is not None else project
            if sampled is not None:
                sampled[idx] = s.token_logprobs(targets, self.chunk).float()
            metrics.update({k.replace("teacher/", f"teacher/{self.routes[r].label}/", 1): v
                            for k, v in s.metrics.items()})
            # the route's share of the step's action tokens (over a teacher's own share of its calls)
            share = float((supervised[idx] & part.batch.teacher.bool()).sum()) / max(1, n)
            metrics[f"teacher/{self.routes[r].label}/supervised_share"] = share
        if logp is None and "distribution" in self.reads:  # no call of this step had a route
            width = self._width()
            logp = torch.full((n, width), -float(torch.log(torch.tensor(float(width)))))
        batch.teacher = batch.teacher & routed.to(batch.teacher.device)  # no route: no teacher
        metrics["teacher/unrouted_share"] = float((~routed).sum()) / max(1, n)
        return TeacherScores(top=TopK(top_ids, top_logp, project) if top_ids is not None else None, sampled=sampled,
                             supervised=supervised, metrics=metrics, logp=logp)

    def _width(self) -> int:
        """The vocabulary of the teachers' distributions (the full estimator's routes are local)."""
        model = next(t.model for t in self.teachers if t.model is not None)
        return int(model.get_output_embeddings().weight.shape[0])

    def evaluate(self, actor: Callable[[Any, Any], Any], log: Callable[[str], None]) -> dict[str, float] | None:
        """A routing table is not one agent: not evaluated as the run's agent."""
        log("teacher: a routing table (" + ", ".join(r.text() for r in self.routes) + "); not evaluated as one agent")
        return None


def check_topk_vocabularies(routes: Sequence[Route], teachers: Sequence[Teacher], topk: int) -> None:
    """The top-k estimator reads one vocabulary a step: a teacher of another tokenizer gives its
    top-k in its own ids, which cannot share a step with another teacher's."""
    from memopd.learn.teachers.other_tokenizer import CrossTokenizerTeacher

    if not topk:
        return
    others = {id(t) for t in teachers if isinstance(t, CrossTokenizerTeacher)}
    if others and len({id(t) for t in teachers}) > 1:
        r = next(r for r, t in zip(routes, teachers) if id(t) in others)
        raise ConfigError(f"--teacher {r.text()}: a teacher of another tokenizer gives its top-k in its own "
                          "vocabulary, which cannot share a step with another route's teacher; use --opd-estimator "
                          "sampled, or one teacher of another tokenizer for every route")


def load_routed(cfg: CoreConfig, routes: Sequence[Route], load_one: Callable[[Any, Route], Teacher], *,
                reads: frozenset[str], topk: int, pad_token_id: int) -> RoutedTeacher:
    """The routing table's teachers (one per distinct teacher: routes that name the same spec, for
    the same env where it is ``auto``, share it), checked, as a :class:`RoutedTeacher`."""
    from memopd.learn.mix import env_config, env_mix, episode_tags

    specs = {s.tag: s for s in env_mix(cfg)}
    built: dict[tuple[str, str], Teacher] = {}
    teachers = []
    for r in routes:
        auto_env = r.env if r.spec == "auto" and r.env != ANY else ""
        if r.spec == "auto" and r.env == ANY and cfg.env_mix:
            raise ConfigError(f"--teacher {r.text()}: the auto teacher is built for one env; route it to an env "
                              f"(e.g. --teacher {next(iter(specs))}=auto)")
        key = (r.spec, auto_env)
        if key not in built:
            one = env_config(cfg, specs[auto_env]) if auto_env else cfg
            try:
                built[key] = load_one(dataclasses.replace(one, teacher=r.spec, teacher_routes=[]), r)
            except ConfigError as exc:  # name the route the teacher was asked for
                raise ConfigError(str(exc).replace(f"--teacher {r.spec}", f"--teacher {r.text()}", 1)) from None
        teachers.append(built[key])
    check_topk_vocabularies(routes, teachers, topk)
    return RoutedTeacher(routes, teachers, episode_tags(cfg), reads=reads, topk=topk, chunk=cfg.kl_chunk,
                         pack_tokens=cfg.pack_tokens, roles=cfg.teacher_roles(), pad_token_id=pad_token_id)


__all__ = ["ANY", "Route", "RouteBatch", "RoutedTeacher", "call_routes", "is_route", "load_routed", "parse_route",
           "parse_routes", "pick", "route_table", "split_batch", "teacher_flags"]
