"""BENCHMARKS.md: the benchmarks whose JSON is in docs/data/."""

from __future__ import annotations

from doctables.core import Data, bold, f, md, table, thousands

VS_TRL = "vs_trl/"
VS_TRL_ROWS = ("tiny-memagent-g1", "tiny-memagent-chunk-first-g1", "tiny-memagent-g4", "tiny-memagent-chunk-first-g4",
               "smollm2-memagent-g1", "smollm2-memagent-chunk-first-g1", "smollm2-memagent-g4",
               "smollm2-memagent-chunk-first-g4")


@table("benchmarks.estimators")
def estimators(d: Data) -> str:
    res = d("estimators.json")
    rows = [[r["estimator"], thousands(r["bytes_per_token"]), f(r["teacher_s"] * 1000, 0), f(r["mean_abs_err"]),
             f(r["max_abs_err"], 2), f"{r['bias']:+.3f}"] for r in res["rows"]]
    return md(["estimator", "bytes a token", "teacher ms a step", "mean abs error", "max abs error",
               "mean error (bias)"], rows)


@table("benchmarks.served_teacher")
def served_teacher(d: Data) -> str:
    rows_in = d("served_teacher.json")["rows"]
    local = rows_in["full (local)"]["teacher_s_per_step"]
    rows = []
    for name, r in rows_in.items():
        where, est = name.rsplit(" (", 1)[1].rstrip(")"), name.rsplit(" (", 1)[0]
        gap = "0" if r["max_abs_logp_gap"] == 0 else f"{r['max_abs_logp_gap']:.1e}"
        rows.append([f"{where}, {est}", f(r["teacher_s_per_step"], 2), f"{r['teacher_s_per_step'] / local:.1f}x"
                     if where != "local" else "1.00x", thousands(r["read_bytes_per_action"]),
                     thousands(r["wire_bytes_per_action"]), gap])
    return md(["teacher, estimator", "teacher s / step", "x local", "read B / action", "wire B / action",
               "max abs gap to local"], rows)


@table("benchmarks.lora")
def lora(d: Data) -> str:
    t = d("smollm2_lora/results.json")["table"]
    full, lo = t["ppo+memopd"], t["ppo+memopd-lora"]
    rows = []
    for name, key, scale, digits in (
            ("peak resident memory of the trainer process (`ru_maxrss`, MiB)", "peak_rss_mb", 1, 0),
            ("seconds a step (rollout + update)", "s_per_step", 1, 1),
            ("of which the update (teacher forward, student forward and backward, optimizer step)",
             "update_s_per_step", 1, 1),
            ("a checkpoint (MiB)", "checkpoint_bytes", 2**20, 1)):
        a, b = full[key] / scale, lo[key] / scale
        rows.append([name, thousands(a, digits), thousands(b, digits), f(b / a, 3 if b / a < 0.1 else 2)])
    return md(["", "full weights", "LoRA r = 16", "LoRA / full"], rows)


@table("benchmarks.lora_sync")
def lora_sync(d: Data) -> str:
    r = d("lora_sync.json")
    return md(["push to the engine", "seconds"], [
        ["full weights (`load_weights` of the plain state dict)", f(r["full_push_s"], 2)],
        ["LoRA: merge (W + B A alpha / r) and push",
         f"{f(r['lora_push_s'], 2)} ({r['lora_push_s'] / r['full_push_s']:.2f}x)"],
        ["of which the merge", f(r["merge_s"], 2)]])


@table("benchmarks.vs_trl")
def vs_trl(d: Data) -> str:
    rows = []
    for name in VS_TRL_ROWS:
        r = d(VS_TRL + name + ".json")
        tok = r["trl_computed_tokens"] / r["memopd_batch_tokens"]
        digits = 2 if r["model"] == "tiny" else 1
        times = f"{f(r['update_s']['trl'], digits)} / {f(r['update_s']['memopd'], digits)}"
        rows.append([r["model"], r["template"], r["group_size"], r["calls"], thousands(r["action_tokens"]),
                     f"{thousands(r['trl_computed_tokens'])} / {thousands(r['memopd_batch_tokens'])} ({tok:.2f}x)",
                     f"{r['loss']['relative_diff']:.1e}", f"{times} (" + bold(f"{r['speedup']:.2f}x") + ")",
                     f"{thousands(r['peak_mib']['trl'])} / {thousands(r['peak_mib']['memopd'])} "
                     f"({r['memory_ratio']:.2f}x)"])
    return md(["student", "prompt order", "G", "calls", "completion tokens", "tokens computed, TRL / memopd",
               "loss, relative difference", "update s, TRL / memopd",
               "memory growth, first update (MiB), TRL / memopd"], rows)


@table("benchmarks.step_profile")
def step_profile(d: Data) -> str:
    before, after = d("step_profile_before.json"), d("step_profile.json")

    def cells(key: str, r: dict) -> str:
        s = r["phase_s"][key]
        share = s / r["step_s"]
        return f"{s:.1f} ({share:.0%})" if share >= 0.01 else f"{s:.2f} ({share:.1%})"

    rows = [["rollout (HFBackend sampling)", cells("rollout", before), cells("rollout", after)],
            ["teacher forward", cells("teacher", before), cells("teacher", after)]]
    fb = [r["update"]["forward_backward_s"] for r in (before, after)]
    rows.append(["update: student forward + backward",
                 *(f"{x:.1f} ({x / r['step_s']:.0%})" for x, r in zip(fb, (before, after)))])
    rows.append(["update: optimizer step (fused AdamW)", cells("optimizer", before), cells("optimizer", after)])
    rest = [sum(r["phase_s"][k] for k in ("pack", "advantages", "prepare", "weigh", "other")) for r in (before, after)]
    rows.append(["packing, advantages, weights, the rest", *(f(x, 3) for x in rest)])
    rows.append(["step", *(f(r["step_s"], 1) for r in (before, after))])
    return md(["phase", "before, s (share)", "after, s (share)"], rows)


@table("benchmarks.vs_trl_second_update")
def vs_trl_second_update(d: Data) -> str:
    rows = []
    for name, g, order in (("mem-smollm2-memagent-g4-steady", 4, "memagent"),
                           ("smollm2-memagent-chunk-first-g1", 1, "memagent-chunk-first")):
        r = d(VS_TRL + name + ".json")
        trl, mem = r["steady_peak_mib"]["trl"], r["steady_peak_mib"]["memopd"]
        rows.append(["smollm2", order, g, f"{thousands(trl)} / {thousands(mem)} (" + bold(f"{mem / trl:.2f}x") + ")"])
    return md(["student", "prompt order", "G", "peak MiB over the resident memory before the first update, second "
               "update, TRL / memopd"], rows)


PROCESS = VS_TRL + "mem-smollm2-memagent-g4-process.json"
MALLOC = {"exact": "glibc returns freed blocks (the benchmark's setting)", "default": "glibc's defaults"}


@table("benchmarks.vs_trl_process")
def vs_trl_process(d: Data) -> str:
    """Both measures of each tool's memory, side by side: the growth over the resident memory before
    the first update (what the benchmark reports) and the process's peak resident memory."""
    res = d(PROCESS)
    rows = []
    for mode, children in res["children"].items():
        for tool in ("trl", "memopd"):
            c = children[tool]
            peak_at = next(m["phase"] for m in c["timeline"] if m["peak_mib"] >= c["process_peak_mib"] - 0.5)
            rows.append([MALLOC[mode], tool, thousands(c["base_mib"]), thousands(c["peak_mib"]),
                         thousands(c["steady_peak_mib"]),
                         thousands(c["base_mib"] + max(c["peak_mib"], c["steady_peak_mib"])),
                         bold(thousands(c["process_peak_mib"])), peak_at.split(":")[0]])
    return md(["malloc", "tool", "resident before the first update", "growth, first update",
               "growth, second update", "resident + largest growth", "the process's peak (`ru_maxrss`)",
               "peak reached by"], rows)


@table("benchmarks.env_throughput")
def env_throughput(d: Data) -> str:
    r = d("env_throughput.json")
    rows = [[f"{t['env']} default ({t['steps'] / t['episodes'] - 1:.0f} chunks and the answer an episode)",
             f"{thousands(t['steps_per_s'])} steps/s ({thousands(t['episodes_per_s'])} episodes/s)"]
            for t in r["throughput"]]
    for m in r["memory"]:
        rows.append([f"LongQA {thousands(m['context_length'])}-word episode: tracemalloc peak / RSS growth",
                     f"{m['tracemalloc_peak_kib']} KiB / {m['rss_growth_kib']} KiB"])
    big = r["memory"][-1]
    rows.append([f"{thousands(big['context_length'])}-word episode, wall time (untraced)",
                 f"{big['seconds']:.2f} s (about {big['words_per_s'] / 1000:.0f}k words/s)"])
    ratio = r["ratio_large_to_small"]
    rows.append([bold(f"context x{ratio['context']:.0f} -> peak Python memory x{ratio['tracemalloc_peak']:.2f}"),
                 "flat"])
    return md(["measurement", "value"], rows)


@table("benchmarks.packing")
def packing(d: Data) -> str:
    rows_in = d("packing.json")["layouts"]
    a = rows_in[0]
    rows = []
    for r in rows_in:
        main = r["layout"].startswith("(c) packed")
        cells = [r["layout"], thousands(r["tokens"]), f(r["tokens"] / a["tokens"], 2),
                 f"{1 - r['real_tokens'] / r['tokens']:.1%}", f(r["attn_entries"] / a["attn_entries"], 2),
                 f(r["cpu_s"], 2), f(a["cpu_s"] / r["cpu_s"], 2), f(r["wall_s"], 2), f(a["wall_s"] / r["wall_s"], 2)]
        rows.append([bold(c, main) for c in cells])
    return md(["layout", "tokens computed", "x (a)", "padding", "attn x (a)", "CPU s", "speed-up (CPU)", "wall s",
               "speed-up (wall)"], rows)


@table("benchmarks.packing_kl")
def packing_kl(d: Data) -> str:
    names = {True: "chunked, {chunk:,} tokens per chunk, checkpointed (`memopd.scoring.reverse_kl`)",
             False: "unchunked (`[{tokens}, {vocab}]` log-distributions of both models in one graph)"}
    rows = [[names[r["chunk"] > 0].format(**r), f"{thousands(r['peak_mib'])} MiB", f"{r['seconds']:.0f} s"]
            for r in d("packing.json")["kl"]]
    return md(["KL computation", "peak memory", "time"], rows)


PROFILE_PHASES = ("prefill", "decode", "generate", "env", "save", "agent")


@table("benchmarks.eval_profile")
def eval_profile(d: Data) -> str:
    """Where an evaluation's CPU time went per model call, before and after the fast path."""
    rows = []
    for label, path, batch in (("before (`b130929`, batch 8)", "eval_speed/profile-base-tiny.json", 8),
                               ("now (batch 64)", "eval_speed/profile-head-tiny.json", 64)):
        r = d(path)
        rows.append([label, *(f(r["ms_per_call"][p], 2) for p in PROFILE_PHASES), f(r["calls_per_cpu_s"], 1)])
    return md(["ms per call", "prefill", "decode", "rest of generate", "env", "writing records", "agent",
               "calls per CPU second"], rows)



EVAL_SPEED_ARMS = {"base": "before (`{base}`), batch 8", "head@8": "now, batch 8", "head": "now, batch {batch}"}


@table("benchmarks.eval_speed")
def eval_speed(d: Data) -> str:
    """memopd.eval at length: calls per second of the older path and this one, from one run."""
    r = d("eval_speed/eval_speed.json")
    rows = []
    for name, m in r["models"].items():
        base = m["arms"]["base"]
        for arm, a in m["arms"].items():
            label = EVAL_SPEED_ARMS[arm].format(base=r["base_commit"][:7], batch=min(64, r["episodes"]))
            now = arm == "head"
            wall, cpu = a["calls_per_s"], a["calls_per_cpu_s"]
            rows.append([bold(c, now) for c in (
                name, label, thousands(a["calls"]), f(wall, 1), f(wall / base["calls_per_s"], 2), f(cpu, 1),
                f(cpu / base["calls_per_cpu_s"], 2), f(a["f1"]))])
        rec = m["records_head_vs_base"]
        same = "identical" if rec["same_prompts_positions_and_ids"] else "**differ**"
        rows.append([name, f"records, now against before ({thousands(rec['calls'])} calls)",
                     f"prompts, positions, sampled ids {same}", f"max log-prob diff {rec['max_abs_logprob_diff']:.1e}",
                     "", "", "", ""])
    return md(["model", "path", "calls", "calls / s (wall)", "x before", "calls / CPU s", "x before", "F1"], rows)


@table("benchmarks.first_run")
def first_run(d: Data) -> str:
    runs = d("threads.json")["first_run"]["runs"]
    quiet = runs["quiet"]["seconds"]
    rows = [[load, f(r["seconds"], 1), f"{r['seconds'] / quiet:.2f}x", f(r["teacher_f1"]),
             f"{f(r['f1_before'])} -> {f(r['f1_after'])}"] for load, r in runs.items()]
    return md(["load", "seconds", "x quiet", "teacher F1", "student held-out F1"], rows)


@table("benchmarks.threads")
def threads(d: Data) -> str:
    res = d("threads.json")["shortened"]["results"]
    one = res["1"]["total_s"]
    rows = [[t, f(r["sft_s"], 1), f(r["train_s"], 1), f(r["total_s"], 1), f"{r['total_s'] / one:.2f}x"]
            for t, r in sorted(res.items())]
    return md(["--threads", "teacher SFT s", "training s", "total s", "x --threads 1"], rows)


GPU_CHECK = "gpu_check/results.json"


@table("benchmarks.gpu_check")
def gpu_check(d: Data) -> str:
    """benchmarks/gpu_check.py on one GPU: each lowering's packed logits against the model's own
    forward of every call alone, and its gradient against the dense sdpa lowering's."""
    rows = [[r["model"], r["dtype"], r["lowering"], f"{r['max_abs_dlogit']:.1e}", f"{r['tol']:.0e}",
             f"{r['grad_diff_vs_sdpa']:.1e}", r["verdict"]] for r in d(GPU_CHECK)["rows"]]
    return md(["model", "dtype", "lowering", "max abs logit diff vs alone", "tolerance", "grad diff vs sdpa",
               "verdict"], rows)


@table("benchmarks.gpu_check_timing")
def gpu_check_timing(d: Data) -> str:
    """The timing section: actor forward + backward, padded against the packed lowerings (one run)."""
    timing = d(GPU_CHECK)["timing"]
    base = timing[0]["ms"]
    return md(["layout, lowering", "ms (best of 3)", "speed-up vs padded"],
              [[f"({t['case']}) {t['what']}", f(t["ms"], 1), f"{base / t['ms']:.2f}x"] for t in timing])
