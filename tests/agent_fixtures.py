"""Helpers shared by the agent tests: a tokenizer trained in process, episode checks."""

from __future__ import annotations

import torch

from agents.backends.hf import HFBackend
from agents.prompts import template_corpus
from agents.records import Invocation

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def train_tokenizer(chat_template: str | None = CHATML, bos: bool = False):
    """A byte-level BPE trained on a small corpus, in process (independent of the presets)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from memgym.generators.longqa import tokenizer_corpus

    corpus = template_corpus() + list(tokenizer_corpus(n_samples=60))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=1000, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<s>" if bos else None, chat_template=chat_template)


def assert_memory_is_exact(episode, infos, tokenizer):
    """Check every consecutive pair of calls of a recorded MemAgent episode; returns how many
    memories were cut shorter than sampled."""
    from agents.policy import strip_stop

    invs = episode.invocations
    prefix = invs[0].prompt_ids[:invs[0].prefix_len]
    assert len(prefix) > 0
    cuts = 0
    for t, inv in enumerate(invs):
        assert inv.prompt_ids[:inv.prefix_len] == prefix  # identical shared prefix in every call
        start, end = inv.spans["memory"]
        memory = inv.prompt_ids[start:end]
        if t == 0:
            assert memory == []
            continue
        sampled = strip_stop(invs[t - 1])
        info = infos[t]  # the info the agent read before call t
        if info["memory_truncated"]:
            # The env cut the text: keep the first memory_size sampled ids. (Its re-encoding of the
            # text may have more tokens than were sampled; then every sampled id is kept.)
            assert memory == sampled[: info["memory_size"]]
            cuts += len(memory) < len(sampled)
        else:
            assert memory == sampled
    return cuts


def run_recorded_episode(env, agent, seed):
    """An episode, keeping the info seen before each call (to check the env's cuts)."""
    obs, info = env.reset(seed=seed)
    infos = []
    while True:
        infos.append(info)
        obs, reward, done, _, info = env.step(agent.act(obs, info))
        if done:
            return agent.end_episode(info, reward), infos




class CountingBackend(HFBackend):
    """The real HF backend, counting its generate calls and batch sizes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []

    def generate(self, requests, sampling):
        self.batches.append(len(requests))
        return super().generate(requests, sampling)


def rescore(model, inv: Invocation, temperature: float = 1.0) -> torch.Tensor:
    """Independent check of a backend's records: one transformers forward over prompt + response,
    no cache, no padding, the recorded positions; log-probs of the response tokens under softmax(logits / T)."""
    ids = torch.tensor([inv.input_ids])
    pos = torch.tensor([inv.position_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    n = inv.prompt_len
    return logp[n - 1:-1].gather(-1, torch.tensor(inv.response_ids)[:, None])[:, 0]


class NaiveBackend(HFBackend):
    """The reference path: each request alone, every token by a full forward over the prompt and
    the tokens sampled so far (no cache, no padding, no batching), the recorded positions. Its
    samples use the same per-request uniforms as :class:`HFBackend` (the sampling rule is not
    what it checks: the forward path is)."""

    def _generate_batch(self, reqs, gens, sp, stop_ids):
        return [self._one(r, g, sp, stop_ids) for r, g in zip(reqs, gens)]

    def _one(self, req, gen, sp, stop_ids):
        tokens, logps, reason = [], [], "length"
        end = req.position_offset + len(req.prompt_ids)
        budget = sp.max_new_tokens if self.max_context is None else min(sp.max_new_tokens, self.max_context - end)
        while len(tokens) < budget:
            ids = torch.tensor([req.prompt_ids + tokens])
            pos = torch.arange(req.position_offset, end + len(tokens))[None]
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, -1, :]
            tok, lp = self._sample(logits.float(), [gen], sp)
            tokens.append(int(tok[0]))
            logps.append(float(lp[0]))
            if tokens[-1] in stop_ids:
                reason = "eos" if tokens[-1] in self.eos_ids else "stop"
                break
        return Invocation(prompt_ids=list(req.prompt_ids), response_ids=tokens, logprobs=logps,
                          position_ids=list(range(req.position_offset, end + len(tokens))), prefix_len=req.prefix_len,
                          role=req.role, turn=req.turn, policy_version=self.policy_version, finish_reason=reason,
                          sampling=sp.to_dict(), timing={"start": 0.0, "latency_s": 0.0},
                          response_text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                          spans=None if req.spans is None else {k: list(v) for k, v in req.spans.items()},
                          meta=dict(req.meta))


def assert_same_records(got, ref, tol: float = 1e-5):
    """Token-exact equality of two runs' records: the same prompts, positions and sampled ids,
    log-probs within ``tol`` (fp32)."""
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert (a.prompt_ids, a.position_ids, a.response_ids, a.finish_reason) == \
            (b.prompt_ids, b.position_ids, b.response_ids, b.finish_reason)
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) <= tol
