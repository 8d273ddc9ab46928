"""Quickstart: run agents on LongQA, offline, on a CPU, in seconds.

1. The oracle (no model): scripted from the supporting facts, it scores F1 = 1.0 and writes
   gold trajectories in the exact record format (token ids, positions, log-probs).
2. MemAgent with the `tiny` preset (an untrained 0.6M-parameter model): real, low scores.

    python examples/quickstart_oracle.py
"""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym

import memgym  # noqa: F401  (registers memgym/LongQA-v0 and the other tasks)
from agents import HFBackend, MemAgent, OracleAgent, SamplingParams, load_episodes, load_model
from agents.rollout import rollout, run_episode


def main() -> None:
    model, tokenizer = load_model("tiny")  # built in process and cached on first use

    # The env counts the memory budget in the agent's tokens: give it the same tokenizer.
    env = gym.make("memgym/LongQA-v0", split="test", tokenizer=tokenizer)
    oracle = OracleAgent.for_env(env, tokenizer=tokenizer)

    episode = run_episode(env, oracle, seed=0)
    print(f"question: {episode.question}")
    for inv in episode.invocations:
        print(f"  {inv.role:<6} prompt {len(inv.prompt_ids):>3} tokens -> {inv.response_text!r}")
    print(f"prediction {episode.prediction!r}, gold {episode.answers}, metrics {episode.metrics}")

    # Many envs in lockstep; episodes are appended to a JSONL file as they finish.
    envs = [gym.make("memgym/LongQA-v0", split="test", tokenizer=tokenizer) for _ in range(8)]
    Path("runs/quickstart/oracle.jsonl").unlink(missing_ok=True)
    episodes = rollout(envs, oracle, 20, seed=0, indices=range(20), out="runs/quickstart/oracle.jsonl")
    print(f"oracle: mean F1 over {len(episodes)} episodes = {sum(e.metrics['f1'] for e in episodes) / 20:.3f}")
    print(f"reloaded {len(load_episodes('runs/quickstart/oracle.jsonl').episodes)} episodes from JSONL")

    # The same loop with a model: every model call of the 8 envs is one batched generate.
    agent = MemAgent(HFBackend(model, tokenizer, seed=0), SamplingParams(temperature=1.0, max_new_tokens=32))
    episodes = rollout(envs, agent, 16, seed=0, indices=range(16))
    print(f"tiny MemAgent (untrained): mean F1 = {sum(e.metrics['f1'] for e in episodes) / 16:.3f}")


if __name__ == "__main__":
    main()
