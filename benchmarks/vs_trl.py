"""memopd's distillation update against TRL's ``DistillationTrainer`` on the same recorded calls.

    pip install "trl==1.16.0"     # benchmark-only (the `bench` extra); not a dependency of memopd
    python benchmarks/vs_trl.py --model tiny --teacher auto --questions 8 --group-size 4
    python benchmarks/vs_trl.py --model smollm2 --teacher DIR --questions 2 --group-size 4 --max-new-tokens 16

One step of MemAgent episodes is sampled by the student (``--questions`` x ``--group-size``,
temperature 1, the prompt order of ``--template``). Both tools then make one distillation update
on every call of the step (``memopd`` packs them; TRL gets one (prompt, completion) sample per
call, the call's restored prompt and its sampled response, with its own left/right padding and
micro-batches of ``--trl-micro-batch``):

- the same divergence: the reverse KL ``KL(student || teacher)`` over the full vocabulary at
  temperature 1 (memopd ``--reward none --opd-divergence rkl``, TRL ``beta=1.0``), averaged over
  every completion token (memopd's masked mean; TRL's sum over micro-batches divided by
  ``num_items_in_batch``, the step's completion tokens);
- the same optimizer step: AdamW, the same learning rate, no weight decay, gradients clipped at
  1.0, one step.

First the losses are compared on the same initial weights (they must agree to ``--tol``
relative); then each update (teacher forward, student forward and backward, optimizer step) is
timed, interleaved, medians of ``--repeats``, each from the same initial weights; then each
update's peak memory is measured in a process of its own (the growth of resident memory over
the process's resident memory before the update, sampled every millisecond, with every weight of
both models read once before it and glibc returning freed blocks; see ``EXACT_MALLOC``): of a
first update, which allocates AdamW's state (two copies of the weights) at its optimizer step,
and of a second, a training step's peak once that state (and whatever else a step keeps, such as
gradients left allocated) is resident; both over the resident memory before the first update.
One torch thread.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


EXACT_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_ARENA_MAX": "1"}
"""glibc settings of the memory processes: every block over 64 KiB is its own mapping, returned
to the system when freed, so resident memory follows the live tensors (with the defaults, memory
freed by the rollout is reused by the update without showing as growth, and the figure depends
on what ran before)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="student model spec")
    ap.add_argument("--teacher", default="auto", help="teacher model spec (the student's tokenizer)")
    ap.add_argument("--env-kwarg", action="append", default=[], help="KEY=VALUE for the env (repeatable)")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--template", default="memagent", help="memagent or memagent-chunk-first (the prompt order)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--warmup-steps", type=int, default=None, help="tiny student: SFT warm-start steps")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--trl-micro-batch", type=int, default=8, help="TRL's per_device_train_batch_size")
    ap.add_argument("--trl-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                    help="TRL's activation checkpointing (on by default in DistillationConfig; switched on as "
                         "Trainer.train() does)")
    ap.add_argument("--micro-batch-rows", type=int, default=None, help="memopd's --micro-batch-rows (default: "
                    "memopd's own)")
    ap.add_argument("--pack-tokens", type=int, default=None, help="memopd's --pack-tokens (default: its own)")
    ap.add_argument("--memopd-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                    help="memopd's --gradient-checkpointing (default: memopd's own)")
    ap.add_argument("--repeats", type=int, default=3, help="timed updates of each tool (0: only the loss check "
                    "and the memory)")
    ap.add_argument("--tol", type=float, default=1e-4, help="relative tolerance of the loss agreement")
    ap.add_argument("--memory", choices=("memopd", "trl"), default=None, help=argparse.SUPPRESS)  # a child
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    return ap.parse_args(argv)


# -- the calls --------------------------------------------------------------------------------------
def memopd_trainer(args: argparse.Namespace, run_dir: str) -> Any:
    from memopd import train

    argv = ["--model", args.model, "--teacher", args.teacher, "--reward", "none", "--opd-coef", "1",
            "--opd-divergence", "rkl", "--ppo-epochs", "1", "--minibatches", "1", "--lr", str(args.lr),
            "--warmup-steps", "0", "--weight-decay", "0", "--max-grad-norm", "1.0",
            "--questions-per-step", str(args.questions), "--group-size", str(args.group_size),
            "--agent-kwarg", f"template={args.template}", "--eval-every", "0", "--eval-episodes", "1",
            "--sample-episodes", "0", "--audit-every", "0", "--threads", "1", "--no-progress",
            "--run-dir", run_dir, "--teacher-cache-mb", "0"]
    if args.micro_batch_rows is not None:
        argv += ["--micro-batch-rows", str(args.micro_batch_rows)]
    for kv in args.env_kwarg:
        argv += ["--env-kwarg", kv]
    if args.max_new_tokens:
        argv += ["--max-new-tokens", str(args.max_new_tokens)]
    if args.pack_tokens:
        argv += ["--pack-tokens", str(args.pack_tokens)]
    if args.memopd_checkpointing is not None:
        argv += ["--gradient-checkpointing" if args.memopd_checkpointing else "--no-gradient-checkpointing"]
    if args.warmup_steps is not None:
        argv += ["--student-warmup-steps", str(args.warmup_steps)]
    cfg = train.prepare(train.cfgmod.parse_args(train.TrainConfig, argv, "vs_trl", ""))
    return train.Trainer(cfg, log=lambda m: None)


class TRLArm:
    """TRL's DistillationTrainer on one (prompt, completion) sample per recorded call."""

    def __init__(self, student: torch.nn.Module, teacher: torch.nn.Module, tokenizer: Any, calls: list[Any],
                 args: argparse.Namespace, out_dir: str):
        from datasets import Dataset
        from trl import DistillationConfig, DistillationTrainer

        config = DistillationConfig(output_dir=out_dir, per_device_train_batch_size=args.trl_micro_batch,
                                    learning_rate=args.lr, beta=1.0, temperature=1.0, weight_decay=0.0,
                                    max_grad_norm=1.0, lr_scheduler_type="constant", report_to="none",
                                    use_cpu=True, bf16=False, disable_dropout=True, logging_strategy="no",
                                    save_strategy="no", gradient_checkpointing=args.trl_checkpointing)
        self.trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config,
                                           train_dataset=Dataset.from_dict({"prompt": ["x"]}),
                                           processing_class=tokenizer)
        self.model = self.trainer.model
        if getattr(self.model, "is_activation_checkpointing", False):  # a copy of a student memopd checkpoints
            self.model.activation_checkpointing_disable()
        if args.trl_checkpointing:  # what Trainer.train() switches on before its loop (not at construction)
            kwargs = dict(self.trainer.args.activation_checkpointing_kwargs or {})
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
        self.opt = self.trainer.create_optimizer()
        self.pad = tokenizer.pad_token_id
        self.batches = [self._batch(calls[i:i + args.trl_micro_batch])
                        for i in range(0, len(calls), args.trl_micro_batch)]
        self.tokens = sum(len(c.response_ids) for c in calls)

    def _batch(self, calls: list[Any]) -> dict[str, torch.Tensor]:
        p = max(len(c.prompt_ids) for c in calls)
        r = max(len(c.response_ids) for c in calls)

        def left(ids, n):
            return [self.pad] * (n - len(ids)) + list(ids), [0] * (n - len(ids)) + [1] * len(ids)

        def right(ids, n):
            return list(ids) + [self.pad] * (n - len(ids)), [1] * len(ids) + [0] * (n - len(ids))

        pi, pm = zip(*(left(c.prompt_ids, p) for c in calls))
        ci, cm = zip(*(right(c.response_ids, r) for c in calls))
        return {"prompt_ids": torch.tensor(pi), "prompt_mask": torch.tensor(pm),
                "completion_ids": torch.tensor(ci), "completion_mask": torch.tensor(cm)}

    def update(self) -> float:
        """One optimizer step over every call; returns the loss (the token mean of the divergence)."""
        self.model.train()
        total, n = 0.0, torch.tensor(float(self.tokens))
        for inputs in self.batches:
            loss = self.trainer.compute_loss(self.model, inputs, num_items_in_batch=n)
            self.trainer.accelerator.backward(loss)
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total

    @property
    def tokens_computed(self) -> int:
        return sum(b["prompt_ids"].numel() + b["completion_ids"].numel() for b in self.batches)


def calls_of(episodes) -> list[Any]:
    calls = [inv for e in episodes for inv in e.invocations]
    assert all(list(c.position_ids) == list(range(c.total_len)) for c in calls), "restored positions must run 0.."
    return calls


def peak_rss_growth(fn, base: int | None = None) -> tuple[Any, float]:
    """``fn()``'s result and the peak of resident memory while it ran over ``base`` bytes (default:
    the resident memory before it), MiB (1 ms samples)."""
    import psutil

    proc, stop, peak = psutil.Process(), threading.Event(), [0]
    base = proc.memory_info().rss if base is None else base

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        out = fn()
    finally:
        stop.set()
        t.join()
    return out, (max(peak[0], proc.memory_info().rss) - base) / 2**20


class Timeline:
    """The process's resident memory and its peak so far (``ru_maxrss``, the whole process's high-water
    mark since it started), MiB, after each named phase: where the process's peak was reached."""

    def __init__(self) -> None:
        self.marks: list[dict[str, Any]] = []

    def __call__(self, phase: str) -> None:
        import resource

        import psutil

        self.marks.append({"phase": phase, "rss_mib": psutil.Process().memory_info().rss / 2**20,
                           "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def setup(args: argparse.Namespace, tmp: str, mark: Timeline | None = None,
          copies: bool = True) -> tuple[Any, Any, list[Any], dict, dict]:
    """The memopd trainer, its step's episodes and calls, and copies of the initial weights (for the
    timed updates; ``copies=False`` leaves them out)."""
    mark = mark or (lambda phase: None)
    trainer = memopd_trainer(args, str(Path(tmp) / "memopd"))
    mark("trainer built: student and teacher loaded")
    episodes = trainer.rollout()
    mark("rollout: one step's episodes sampled")
    init_student = copy.deepcopy(trainer.student.state_dict()) if copies else {}
    init_opt = copy.deepcopy(trainer.updater.opt.state_dict()) if copies else {}
    return trainer, episodes, calls_of(episodes), init_student, init_opt


def fault_in(*models: torch.nn.Module) -> None:
    """Read every weight once: weights loaded from safetensors are mapped from the file and become
    resident at their first use, which would count a model's whole size to whichever tool first
    runs it."""
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                p.sum()


def child_memory(args: argparse.Namespace) -> int:
    """Two updates of one tool in this (fresh) process, as JSON: the peak resident memory of the
    first (which allocates AdamW's state) and of the second (a training step's peak once the
    optimizer's state and whatever else a step keeps are resident), both over the resident memory
    before the first."""
    mark = Timeline()
    mark("start: torch, transformers and memopd imported")
    with tempfile.TemporaryDirectory() as tmp:
        trainer, episodes, calls, _, _ = setup(args, tmp, mark, copies=False)
        fault_in(trainer.student, trainer.teacher.model)
        if args.memory == "memopd":
            update = lambda: trainer.update(episodes)  # noqa: E731
        else:  # TRL trains memopd's student itself: no third copy of the weights in this process
            arm = TRLArm(trainer.student, trainer.teacher.model, trainer.tokenizer, calls, args, str(Path(tmp) / "trl"))
            fault_in(arm.model, arm.trainer.teacher_model if hasattr(arm.trainer, "teacher_model") else arm.model)
            update = arm.update
        mark("weights read once")
        import psutil

        base = psutil.Process().memory_info().rss  # both counted from before the first update:
        _, first = peak_rss_growth(update, base)  # what a step keeps (AdamW's state, any gradients
        mark("first update")
        _, second = peak_rss_growth(update, base)  # held between steps) is in the second's peak
        mark("second update")
    print(json.dumps({"peak_mib": first, "steady_peak_mib": second, "base_mib": base / 2**20,
                      "process_peak_mib": mark.marks[-1]["peak_mib"], "timeline": mark.marks}))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.memory:
        return child_memory(args)
    import transformers
    import trl

    with tempfile.TemporaryDirectory() as tmp:
        trainer, episodes, calls, init_student, init_opt = setup(args, tmp)
        student0 = copy.deepcopy(trainer.student)
        arm = TRLArm(copy.deepcopy(student0), trainer.teacher.model, trainer.tokenizer, calls, args,
                     str(Path(tmp) / "trl"))
        init_trl = copy.deepcopy(arm.model.state_dict())

        def memopd_update() -> dict[str, float]:
            trainer.student.load_state_dict(init_student)
            trainer.updater.opt.load_state_dict(init_opt)
            return trainer.update(episodes).metrics

        def trl_update() -> float:
            arm.model.load_state_dict(init_trl)
            arm.opt.state.clear()  # AdamW from scratch, as memopd's first step
            return arm.update()

        m = memopd_update()
        t_loss = trl_update()
        m_loss = m["opd_loss"]
        rel = abs(m_loss - t_loss) / max(abs(t_loss), 1e-12)
        agree = rel <= args.tol
        print(f"loss: memopd {m_loss:.8f}, TRL {t_loss:.8f}, relative difference {rel:.2e} "
              f"({'agree' if agree else 'DIFFER'} at {args.tol:g})")
        times: dict[str, list[float]] = {"memopd": [], "trl": []}
        for _ in range(args.repeats):  # interleaved: the machine's drift hits both alike
            for name, fn in (("memopd", memopd_update), ("trl", trl_update)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        from memopd.packing import pack_episodes

        batch_tokens = pack_episodes(episodes, trainer.cfg.pack_tokens, mode="aligned").num_real_tokens
        report: dict[str, Any] = {
            "model": args.model, "teacher": args.teacher, "template": args.template, "questions": args.questions,
            "group_size": args.group_size, "calls": len(calls), "action_tokens": sum(len(c.response_ids) for c in calls),
            "call_tokens": sum(c.total_len for c in calls), "trl_computed_tokens": arm.tokens_computed,
            "memopd_batch_tokens": batch_tokens, "trl_micro_batch": args.trl_micro_batch,
            "trl_gradient_checkpointing": args.trl_checkpointing,
            "memopd_settings": {k: getattr(trainer.cfg, k) for k in ("micro_batch_rows", "gradient_checkpointing",
                                                                      "pack_tokens", "kl_chunk")},
            "loss": {"memopd": m_loss, "trl": t_loss, "relative_diff": rel,
                                                                 "agree": agree, "tol": args.tol},
            "update_s": {k: statistics.median(v) if v else None for k, v in times.items()}, "raw_s": times,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
            "command": "python benchmarks/vs_trl.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    report["speedup"] = report["update_s"]["trl"] / report["update_s"]["memopd"] if args.repeats else None
    if not args.no_memory:
        base = [sys.executable, str(Path(__file__).resolve())] + (argv if argv is not None else sys.argv[1:])
        peaks, steady, process, bases, timelines = {}, {}, {}, {}, {}
        for tool in ("memopd", "trl"):
            out = subprocess.run(base + ["--memory", tool], capture_output=True, text=True, check=True,
                                 env={**os.environ, **EXACT_MALLOC}).stdout
            child = json.loads(out.strip().splitlines()[-1])
            peaks[tool], steady[tool] = child["peak_mib"], child["steady_peak_mib"]
            process[tool], bases[tool], timelines[tool] = (child["process_peak_mib"], child["base_mib"],
                                                           child["timeline"])
        report["peak_mib"], report["steady_peak_mib"] = peaks, steady
        report["process_peak_mib"], report["base_mib"], report["timeline"] = process, bases, timelines
        report["process_memory_ratio"] = process["memopd"] / max(process["trl"], 1e-9)
        report["memory_ratio"] = peaks["memopd"] / max(peaks["trl"], 1e-9)
        report["steady_memory_ratio"] = steady["memopd"] / max(steady["trl"], 1e-9)
    timing = (f"update s: memopd {report['update_s']['memopd']:.3f}, TRL {report['update_s']['trl']:.3f} (TRL / "
              f"memopd {report['speedup']:.2f}x)" if args.repeats else "not timed")
    memory = (f"; peak MiB (first update / later): memopd {report['peak_mib']['memopd']:.0f} / "
              f"{report['steady_peak_mib']['memopd']:.0f}, TRL {report['peak_mib']['trl']:.0f} / "
              f"{report['steady_peak_mib']['trl']:.0f} (growth over the resident memory before the first update); "
              f"the process's peak resident memory: memopd {report['process_peak_mib']['memopd']:.0f}, TRL "
              f"{report['process_peak_mib']['trl']:.0f}" if "peak_mib" in report else "")
    print(f"{len(calls)} calls, {report['action_tokens']} completion tokens; {timing}{memory}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
