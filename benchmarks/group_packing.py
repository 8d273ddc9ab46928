"""Group-shared packing: what a question's G samples save when they share stored tokens.

The G samples of a question have the same instructions and question (the prefix) and, with
MemAgent's prompt order (memory before the chunk), the same first call: memory empty, same first
chunk. Packing stores the prefix once per row per episode (``across_episodes=False``, the layout
before group sharing) or once per row for the whole group, and the identical first prompt once
for all its samples, and with the chunk before the memory each turn's prompt up to the memory
once (the default; each such unit stores the prefix again). Measured on a MemAgent-like workload
of 8 episodes (8 questions x 1 sample, 2 x 4, 1 x 8), in both prompt orders: stored tokens of
each layout, next to

* the padded per-call layout (every call with its whole prompt, no sharing; right-padded to the
  longest call of a micro-batch of 8 calls sorted by length), and
* the bound: every run the samples have in common stored once (MemAgent's order: the prefix and
  the first prompt; the chunk-first order, ``MemAgent(template="memagent-chunk-first")``: also
  every turn's chunk),

and the actor forward + backward time of the two packed layouts (process CPU time, one thread,
min over repeats, the ``blocks`` lowering; ``--lowerings blocks sdpa`` adds the dense-mask one),
so the time ratio can be read against the token ratio.

    python benchmarks/group_packing.py            # about 3 minutes on one thread
    python benchmarks/group_packing.py --quick    # tokens only
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing import Workload, packed_step, small_model  # noqa: E402  (benchmarks/packing.py)

from agents.records import Episode, Invocation  # noqa: E402
from memopd.packing import pack_episodes  # noqa: E402

MEM, CHUNK = [1, 2, 3, 4], [5, 6, 7, 8]  # template tokens around the memory and the chunk


def group_episodes(w: Workload, questions: int, group: int, chunk_first: bool = False) -> list[Episode]:
    """``questions`` x ``group`` MemAgent-like episodes: a question's samples share its prefix and
    chunks; their memories (responses) are their own. ``chunk_first``: each memory call's prompt
    has the chunk before the memory."""
    rng = random.Random(w.seed)
    tok = lambda n: [rng.randrange(10, w.vocab) for _ in range(n)]  # noqa: E731
    eps = []
    for qi in range(questions):
        q = tok(rng.randint(*w.prefix))
        chunks = [tok(rng.randint(100 if t == w.calls - 1 else w.chunk[0], w.chunk[1])) for t in range(w.calls)]
        for g in range(group):
            memory: list[int] = []
            invs = []
            for t in range(w.calls + 1):
                answer = t == w.calls
                chunk = [] if answer else chunks[t]
                head = CHUNK + chunk if chunk_first else []
                prompt = q + head + MEM + memory + ([] if chunk_first else CHUNK + chunk)
                resp = tok(rng.randint(*(w.answer if answer else w.memory)))
                m0 = len(q) + len(head) + len(MEM)
                invs.append(Invocation(prompt_ids=prompt, response_ids=resp, logprobs=[-1.0] * len(resp),
                                       position_ids=list(range(len(prompt) + len(resp))), prefix_len=len(q),
                                       role="answer" if answer else "memory", turn=t,
                                       spans={"memory": [m0, m0 + len(memory)]}))
                memory = resp
            eps.append(Episode(episode_id=f"q{qi}-s{g}", task_id="bench", sample_id=str(qi), group_id=f"q{qi}",
                               invocations=invs))
    return eps


def padded_tokens(eps: list[Episode], batch: int = 8) -> int:
    lens = sorted(inv.total_len for e in eps for inv in e.invocations)
    return sum(len(lens[i:i + batch]) * max(lens[i:i + batch]) for i in range(0, len(lens), batch))


def bound(eps: list[Episode], group: int) -> int:
    """Tokens when every run a question's samples have in common is stored once: at each turn the
    longest common prompt prefix of the samples (the prefix; at the first call the whole prompt;
    chunk first, also the turn's chunk), then each sample's rest and response."""
    total = 0
    for k in range(0, len(eps), group):
        members = eps[k:k + group]
        p = members[0].invocations[0].prefix_len
        total += p
        for t in range(len(members[0].invocations)):
            calls = [e.invocations[t] for e in members]
            lcp = 0
            while all(lcp < c.prompt_len for c in calls) and len({c.prompt_ids[lcp] for c in calls}) == 1:
                lcp += 1
            total += lcp - p + sum(c.total_len - lcp for c in calls)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="stored tokens only, no timing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lowerings", nargs="+", default=["blocks"], help="blocks and/or sdpa (dense [L, L] masks: "
                                                                      "slow and memory hungry at 8k-token rows)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    w = Workload(calls=4, vocab=4096)
    budget = 8192
    model = None if args.quick else small_model(w.vocab, 256, 4)
    print("| order | G | padded per call | per-episode prefix | group-shared | bound | group / per-episode tokens "
          "| group / per-episode CPU time, blocks | ..., sdpa |")
    print("|---|---|---|---|---|---|---|---|---|")
    for order in ("memagent", "chunk first"):
        for group in (1, 4, 8):
            eps = group_episodes(w, 8 // group, group, chunk_first=order == "chunk first")
            apart = pack_episodes(eps, budget, across_episodes=False)
            shared = pack_episodes(eps, budget)
            times = {}
            if model is not None:
                for lowering in args.lowerings:
                    for name, batch in (("apart", apart), ("shared", shared)):
                        best = float("inf")
                        for _ in range(args.repeats):
                            model.zero_grad(set_to_none=True)
                            c0 = time.process_time()
                            packed_step(model, batch, lowering)
                            best = min(best, time.process_time() - c0)
                        times[lowering, name] = best
            ratio = lambda lw: (f"{times[lw, 'shared'] / times[lw, 'apart']:.2f}" if (lw, "apart") in times  # noqa: E731
                                else "-")
            print(f"| {order} | {group} | {padded_tokens(eps):,} | {apart.num_real_tokens:,} | "
                  f"{shared.num_real_tokens:,} | {bound(eps, group):,} | "
                  f"{shared.num_real_tokens / apart.num_real_tokens:.2f} | {ratio('blocks')} | {ratio('sdpa')} |",
                  flush=True)


if __name__ == "__main__":
    main()
