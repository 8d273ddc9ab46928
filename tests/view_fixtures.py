"""Realistic episode records for the viewer tests: a byte-level BPE tokenizer trained in-process,
and episodes whose invocations hold real token ids of [prefix, memory, chunk] prompts."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

from agents.records import Episode, Invocation, save_episodes
from memgym.scoring import score_answer

PEOPLE = ["Ada", "Bruno", "Chloé", "Dmitri", "Eun-ji", "Farah", "Goran", "Hiro"]
COMPANIES = ["Acme", "Globex", "Initech", "Umbrella", "Hooli", "Vandelay"]
CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Quito"]
# a memory that tries to inject markup; the viewer must show it as text
SCRIPT_MEMORY = 'Ada works at Acme. </script><script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> <!-- & [bold]x[/bold]'
PREFIX = "You read a long document chunk by chunk and keep a short memory.\nQuestion: {q}\n"


def corpus() -> list[str]:
    lines = [f"{p} works at {c}. {c} is located in {y}." for p in PEOPLE for c in COMPANIES for y in CITIES[:2]]
    lines += [PREFIX.format(q=f"Where does {p} work?") for p in PEOPLE]
    lines += ["Memory: Chunk: Answer: café naïve 東京 😀 <script> </script> & \" ' [bold]"]
    return lines


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    """A byte-level BPE tokenizer (multi-byte characters split across tokens, as in GPT-2/Qwen)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|eos|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def make_episode(tok, index: int, *, question: str, answers: list[str], chunks: list[str],
                 memories: list[str], prediction: str, kl: bool = True, record_texts: bool = True,
                 record_spans: bool = True, task_id: str = "bridge-qa", seed: int = 0) -> Episode:
    """Episode with len(chunks) memory calls then one answer call; memories[t] is written at turn t.
    Prompts are assembled from token-id segments like agents.prompts does it, and the memory of
    call t+1 is the ids sampled at call t."""
    rng = random.Random(seed * 1000 + index)
    prefix = encode(tok, PREFIX.format(q=question))
    invs, memory, memory_ids = [], "", []
    for turn, chunk in enumerate(chunks + [None]):
        role = "memory" if chunk is not None else "answer"
        prompt, spans = list(prefix), {}
        for name, ids in (("memory", memory_ids), ("chunk", encode(tok, chunk) if chunk is not None else None)):
            if ids is None:
                continue
            prompt += encode(tok, f"{name.title()}: ")
            spans[name] = [len(prompt), len(prompt) + len(ids)]
            prompt += ids + encode(tok, "\n")
        action = memories[turn] if role == "memory" else prediction
        response = encode(tok, action)
        meta = {"episode_id": f"ep-{index:05d}"}
        if record_texts:
            meta["memory_text"] = memory
            if chunk is not None:
                meta["chunk_text"] = chunk
        if kl:
            meta["teacher_kl"] = [round(rng.expovariate(2.0), 4) for _ in response]
            meta["teacher_mode"] = "aligned"
        invs.append(Invocation(
            prompt_ids=prompt, response_ids=response, logprobs=[-round(rng.random() * 3, 4) for _ in response],
            position_ids=list(range(len(prompt) + len(response))), prefix_len=len(prefix), role=role, turn=turn,
            policy_version=3, response_text=action, spans=spans if record_spans else None, meta=meta,
            timing={"generate_s": 0.01 * (turn + 1)}))
        if role == "memory":
            memory, memory_ids = action, response
    metrics = score_answer(prediction, answers)
    return Episode(episode_id=f"ep-{index:05d}", task_id=task_id, sample_id=f"s{index}", invocations=invs,
                   reward=metrics["f1"], metrics=metrics, prediction=prediction, answers=answers,
                   question=question, seed=seed, group_id=f"g{index // 2}")


def sample_episodes(tok, n: int = 6, kl: bool = True, record_texts: bool = True,
                    record_spans: bool = True) -> list[Episode]:
    """n episodes: every third one a failure; episode 1 holds the <script> memory and episode 2
    non-ASCII text (é, 東京, emoji) split across byte-level tokens."""
    eps = []
    for i in range(n):
        person, company, city = PEOPLE[i % len(PEOPLE)], COMPANIES[i % len(COMPANIES)], CITIES[i % len(CITIES)]
        chunks = [f"{PEOPLE[(i + 1) % 8]} works at {COMPANIES[(i + 2) % 6]}. The weather was mild.",
                  f"{person} works at {company}. {company} is located in {city}.",
                  f"{PEOPLE[(i + 3) % 8]} works at {COMPANIES[(i + 4) % 6]}."]
        memories = ["Nothing relevant yet.", f"{person} works at {company}.", f"{person} works at {company}."]
        if i == 1:
            memories[1] = memories[2] = SCRIPT_MEMORY
        if i == 2:
            memories[2] = f"{person} works at {company}. café 東京 😀"
        prediction = COMPANIES[(i + 1) % 6] if i % 3 == 0 else company
        eps.append(make_episode(tok, i, question=f"Where does {person} work?", answers=[company, f"{company} Inc."],
                                chunks=chunks, memories=memories, prediction=prediction,
                                kl=kl and i != 4, record_texts=record_texts, record_spans=record_spans))
    return eps


def make_run_dir(path: Path, tok, steps=(2, 10, 4), per_step: int = 3) -> Path:
    """A training run directory as memopd.runlog writes it."""
    path.mkdir(parents=True, exist_ok=True)
    with (path / "metrics.jsonl").open("w") as fh:
        for s in range(1, 13):
            row = {"step": s, "reward": 0.1 + 0.05 * s, "f1": 0.1 + 0.05 * s, "kl/all": 1.0 / s,
                   "kl/memory": 1.2 / s, "kl/answer": 0.5 / s, "entropy": 2.0 - 0.1 * s,
                   "tokens_per_s": 1500.0 + 10 * s, "loss/ppo": 0.01 * s}
            fh.write(json.dumps(row) + "\n")
    for k, step in enumerate(steps):
        eps = sample_episodes(tok, per_step + k)[k:]
        save_episodes(path / "episodes" / f"step-{step}.jsonl", eps)
    (path / "episodes" / "notes.txt").write_text("not an episodes file")
    (path / "config.toml").write_text('[trainer]\nlr = 1e-5\nname = "<b>run</b>"\n')
    return path
