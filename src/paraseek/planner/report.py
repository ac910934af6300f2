"""What `paraseek plan` prints: rich tables for people, one JSON document for programs, a PNG for scaling."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from paraseek.errors import UserError
from paraseek.planner.infer import InferPlan
from paraseek.planner.memory import GiB
from paraseek.planner.plan import Cluster, Plan
from paraseek.planner.search import (MEMORY_HEADROOM, Evaluated, Rejected, ScalingRow, SearchResult, cross_node,
                                     describe_mtp, explain, mtp_cost)


def train_command(model: str, c: Cluster, plan: Plan, seq_len: int, global_batch_size: int) -> str:
    """The `paraseek train` command line that runs `plan`."""
    argv = ["paraseek", "train", "--model", model]
    if c.nodes > 1:  # the same command on every node, with its --node-rank
        argv += ["--nnodes", str(c.nodes), "--node-rank", "RANK", "--rdzv-endpoint", "NODE0_HOST:29500"]
    argv += ["--nproc", str(min(c.gpus_per_node, c.n_gpus)), "--seq-len", str(seq_len),
             "--global-batch-size", str(global_batch_size)]
    argv += [word for flag in plan.flags() for word in flag.split()]
    return shlex.join(argv)


def serve_command(model: str, c: Cluster, r: InferPlan, seq_len: int, weight_dtype: str, kv_cache_dtype: str,
                  max_num_seqs: int, max_batched_tokens: int) -> str:
    """The `paraseek serve` command line that runs the layout of `r` with the engine settings it was priced at: one
    server per node (serve launches its processes on one machine), its GPUs in model copies of the layout."""
    from paraseek.planner.infer import MAX_BATCHED_TOKENS, MAX_NUM_SEQS

    argv = ["paraseek", "serve", model, *r.layout.flags()]
    copies = min(c.n_gpus, c.gpus_per_node) // r.layout.ranks
    argv += ["--dp", str(copies)] if copies > 1 else []
    argv += {"fp8": ["--quantization", "fp8"], "fp16": ["--dtype", "float16"]}.get(weight_dtype, [])
    argv += ["--kv-cache-dtype", "fp8"] if kv_cache_dtype == "fp8" else []
    argv += ["--max-model-len", str(seq_len)]
    argv += ["--max-num-seqs", str(max_num_seqs)] if max_num_seqs != MAX_NUM_SEQS else []  # serve's defaults
    argv += ["--max-batched-tokens", str(max_batched_tokens)] if max_batched_tokens != MAX_BATCHED_TOKENS else []
    return shlex.join(argv) + (f"  # on each of the {c.nodes} nodes" if c.nodes > 1 else "")


def _gib(x: float) -> float:
    return round(x / GiB, 3)


def plan_dict(ev: Evaluated, res: SearchResult) -> dict[str, Any]:
    p = ev.plan
    assert ev.time is not None
    d: dict[str, Any] = p.to_dict()
    d.update(
        n_microbatches=p.n_microbatches(res.global_batch_size),
        memory_gib_per_gpu=_gib(ev.memory.total),
        memory_share=round(ev.memory.total / (res.cluster.memory_gib * GiB), 4),
        above_memory_headroom=ev.tight,
        memory_peak_at=ev.memory.phase,
        memory_peak_pp_rank=ev.memory.worst_rank,
        host_memory_gib_per_node=_gib(ev.memory.host_per_node),
        step_time_s=round(ev.time.total, 4),
        tokens_per_s_per_gpu=round(ev.tokens_per_s_per_gpu, 1),
        tokens_per_s=round(ev.tokens_per_s_per_gpu * p.world, 1),
        mfu=round(ev.mfu, 4),
        command=train_command(res.model, res.cluster, p, res.seq_len, res.global_batch_size),
        memory_breakdown={k: _gib(v) for k, v in ev.memory.items.items()},
        time_breakdown={k: round(v, 4) for k, v in ev.time.items.items()},
    )
    if ev.note:
        d["note"] = ev.note
    if mtp := mtp_cost(res.model_args, res.cluster, ev, res.seq_len, res.global_batch_size):
        d["mtp"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in mtp.items()}
    return d


def rejected_dict(r: Rejected) -> dict[str, Any]:
    d: dict[str, Any] = dict(r.mesh)
    if r.plan is not None:
        d["closest_plan"] = r.plan.to_dict()
    if r.memory is not None:
        d["memory_gib_per_gpu"] = _gib(r.memory.total)
        d["host_memory_gib_per_node"] = _gib(r.memory.host_per_node)
        d["memory_breakdown"] = {k: _gib(v) for k, v in r.memory.items.items()}
    d["reason"] = r.reason
    return d


def hardware_dict(c: Cluster) -> dict[str, Any]:
    return {"gpu": c.gpu.name, "n_gpus": c.n_gpus, "gpus_per_node": c.gpus_per_node, "memory_gib": c.memory_gib,
            "peak_tflops": c.peak_tflops, "matmul_tflops": c.matmul_tflops,
            "intra_node_busbw_gbps": c.intra_busbw_gbps, "inter_node_busbw_gbps": c.inter_busbw_gbps,
            "hbm_gbps": c.hbm_gbps, "host_memory_gib": c.host_memory_gib, "precision": c.precision,
            "notes": list(c.notes)}


def search_json(res: SearchResult, top: int) -> dict[str, Any]:
    plans = res.plans[:top] if top else res.plans
    doc = {"mode": "train", "model": res.model, "hardware": hardware_dict(res.cluster), "seq_len": res.seq_len,
           "global_batch_size": res.global_batch_size, "memory_headroom": MEMORY_HEADROOM,
           "plans": [plan_dict(e, res) for e in plans],
           "rejected": [rejected_dict(r) for r in res.rejected], "plans_priced": res.evaluated}
    if res.plans:
        doc["why_first"] = explain(res.model_args, res.cluster, res.plans[0], res.seq_len, res.global_batch_size)
    if not res.plans:
        doc["why_none"] = res.why_none
    return doc


WIDTH = 100  # the tables are laid out for 100 columns: every column stays at any terminal width >= that


def _console():
    from rich.console import Console

    con = Console()
    if not con.is_terminal or con.width < WIDTH:  # logs, pipes and narrow terminals: rich would drop columns
        con = Console(width=WIDTH, force_terminal=con.is_terminal)
    return con


_SHORT = {"GPipe": "GPipe", "1F1B": "1F1B", "Interleaved1F1B": "I1F1B", "ZBVZeroBubble": "ZBV", "DualPipeV": "DPV"}


def _schedule(p: Plan) -> str:
    if p.pp == 1:
        return "1"
    v = f" v{p.pp_virtual_stages}" if p.pp_schedule == "Interleaved1F1B" else ""
    return f"{p.pp} {_SHORT[p.pp_schedule]}{v}"


def _table(title: str, columns: tuple[str, ...]):
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i == 0 and not col.startswith("#") else "right", no_wrap=True)
    return t


def print_search(res: SearchResult, top: int) -> None:
    con = _console()
    con.print(f"[bold]{res.model}[/bold] on {res.cluster.describe()}; seq {res.seq_len}, global batch "
              f"{res.global_batch_size} sequences; {res.evaluated:,} plans priced")
    for note in res.cluster.notes:
        con.print(f"note: {note}", markup=False, highlight=False)
    if res.plans:
        t = _table("best variant of each mesh, with headroom first, then fastest; dp = replicate x shard",
                   ("#", "dp", "tp", "pp", "ep", "mbs", "AC", "comp", "offl", "GiB", "step s", "tok/s/GPU", "MFU"))
        shown = res.plans[:top] if top else res.plans
        for i, e in enumerate(shown, 1):
            p = e.plan
            t.add_row(str(i), f"{p.dp_replicate}x{p.dp_shard}", str(p.tp), _schedule(p), str(p.ep),
                      str(p.micro_batch_size), p.activation_checkpointing, "yes" if p.compile else "",
                      "cpu" if p.cpu_offload else "", f"{e.memory.total / GiB:.1f}" + ("!" if e.tight else ""),
                      f"{e.time.total:.2f}", f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.mfu:.1%}")
        con.print(t)
        if any(e.tight for e in shown):
            con.print(f"!: above the {MEMORY_HEADROOM:.0%} memory headroom: the caching allocator fragments there "
                      "(measured on H200: such runs lost 13-29%)", markup=False, highlight=False)
        best = res.plans[0]
        mem = _table(f"#1 memory, peak at {best.memory.phase}", ("item", "GiB/GPU"))
        for k, v in best.memory.items.items():
            if v:
                mem.add_row(k.replace("_", " "), f"{v / GiB:.2f}")
        mem.add_row("[bold]total[/bold]", f"[bold]{best.memory.total / GiB:.2f}[/bold]")
        tim = _table("#1 time per step", ("item", "s"))
        assert best.time is not None
        for k, v in best.time.items.items():
            if v:
                tim.add_row(k.replace("_", " "), f"{v:.3f}")
        tim.add_row("[bold]step[/bold]", f"[bold]{best.time.total:.3f}[/bold]")
        from rich.columns import Columns

        con.print(Columns([mem, tim]))
        if best.memory.host_per_node:
            con.print(f"host memory for offloaded states: {best.memory.host_per_node / GiB:,.0f} GiB per node")
        con.print("why #1: " + explain(res.model_args, res.cluster, best, res.seq_len, res.global_batch_size),
                  markup=False, highlight=False)
        if mtp := mtp_cost(res.model_args, res.cluster, best, res.seq_len, res.global_batch_size):
            con.print(describe_mtp(mtp, best.plan.pp), markup=False, highlight=False)
        con.print("run it: " + train_command(res.model, res.cluster, best.plan, res.seq_len, res.global_batch_size),
                  soft_wrap=True, markup=False, highlight=False)
    else:
        con.print(f"[bold red]no plan fits[/bold red] {res.cluster.n_gpus} x {res.cluster.gpu.name}: {res.why_none}",
                  highlight=False)
    if res.rejected:
        shown = res.rejected[: max(top, 5)]
        con.print(f"\n{len(res.rejected)} meshes rejected; closest first:")
        for r in shown:
            mesh = " ".join(f"{k}={v}" for k, v in r.mesh.items())
            con.print(f"  {mesh}: {r.reason}", markup=False, highlight=False)


# ---- inference ---------------------------------------------------------------------------------------------------
def _sig(x: Any, digits: int = 5) -> Any:
    """x with every float rounded to `digits` significant digits (for JSON a person reads too)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: _sig(v, digits) for k, v in x.items()}
    if isinstance(x, list):
        return [_sig(v, digits) for v in x]
    return x


def infer_json(model: str, c: Cluster, seq_len: int, rows: list[InferPlan],
               weight_dtype: str = "bf16") -> dict[str, Any]:
    from paraseek.planner.infer_speed import terms

    fits = [r for r in rows if not r.reason]
    fits.sort(key=lambda r: -r.decode_tokens_per_s_per_gpu)

    def layout(r: InferPlan) -> dict[str, Any]:
        lay = r.layout
        return {"layout": lay.name, "tp": lay.tp, "ep": lay.ep, "dp_attention": lay.dp_attention,
                "gpus_per_model_copy": lay.ranks, "command": r.command}

    def row(r: InferPlan) -> dict[str, Any]:
        d = {**layout(r), "replicas": r.replicas, "weights_gib_per_gpu": round(r.weights_gib, 3),
             "kv_cache_bytes_per_token": r.kv_bytes_per_token, "kv_cache_free_gib": round(r.free_gib, 3),
             "kv_cache_tokens_per_model_copy": r.kv_tokens,
             "max_batch_at_seq_len": r.max_batch, "max_context_at_batch_1": r.max_context, "batch": r.batch,
             "decode_tokens_per_s_per_gpu": round(r.decode_tokens_per_s_per_gpu, 1),
             "prefill_tokens_per_s_per_gpu": round(r.prefill_tokens_per_s_per_gpu, 1)}
        if r.speed is not None:
            d["speed"] = _sig(r.speed)
        return d

    def rejected(r: InferPlan) -> dict[str, Any]:
        d = {**layout(r), "max_batch_at_seq_len": r.max_batch, "batch": r.batch, "reason": r.reason}
        if r.speed is not None:
            d["speed"] = _sig(r.speed)
        return d

    return {"mode": "infer", "model": model, "hardware": hardware_dict(c), "seq_len": seq_len,
            "weight_dtype": weight_dtype, "speed_terms": terms(), "plans": [row(r) for r in fits],
            "rejected": [rejected(r) for r in rows if r.reason]}


def print_infer(model: str, c: Cluster, seq_len: int, rows: list[InferPlan], max_seq_len: int,
                weight_dtype: str = "bf16") -> None:
    con = _console()
    con.print(f"[bold]{model}[/bold] inference on {c.describe()}; context {seq_len}; {weight_dtype} weights"
              + (" (`paraseek serve --dtype float16`)" if weight_dtype == "fp16" else ""))
    for note in c.notes:
        con.print(f"note: {note}", markup=False, highlight=False)
    t = _table(f"per layout (a model copy on max(tp, ep) GPUs: its weights per GPU, its KV cache tokens and "
               f"batches at context {seq_len}, tokens/s per GPU)",
               ("layout", "GiB/GPU", "KV KiB/tok", "KV tokens", "max batch", "max ctx", "batch", "decode",
                "prefill"))
    fits = [r for r in rows if not r.reason]
    for r in fits:
        ctx = f"{min(r.max_context, max_seq_len):,}" + ("*" if r.max_context > max_seq_len else "")
        t.add_row(r.layout.name, f"{r.weights_gib:.1f}", f"{r.kv_bytes_per_token / 1024:.1f}", f"{r.kv_tokens:,}",
                  f"{r.max_batch:,}", ctx, f"{r.batch:,}", f"{r.decode_tokens_per_s_per_gpu:,.0f}",
                  f"{r.prefill_tokens_per_s_per_gpu:,.0f}")
    if fits:
        con.print(t)
        if any(r.max_context > max_seq_len for r in fits):
            con.print("*: the model's max_position_embeddings (more would fit)", highlight=False)
        best = max(fits, key=lambda r: r.decode_tokens_per_s_per_gpu)
        con.print(f"run it ({best.layout.name}, the most decode tokens/s per GPU): {best.command}", markup=False,
                  highlight=False)
    else:
        con.print("[bold red]no layout fits[/bold red] (below)", highlight=False)
    for r in rows:
        if r.reason:
            con.print(f"  {r.layout.name}: {r.reason}", markup=False, highlight=False)
    speeds = [r for r in rows if r.speed is not None]
    if not speeds:
        return
    e = speeds[0].speed["engine"]
    con.print(f"speed (predicted; engine at --max-num-seqs {e['max_num_seqs']} --max-batched-tokens "
              f"{e['max_batched_tokens']}):", highlight=False)
    for r in speeds:
        s = r.speed
        steps = ", ".join(f"{d['batch']}: {d['ms_per_step']:.2f} ms = {d['tokens_per_s']:,.0f} tok/s"
                          + ("" if d["fits"] else " (does not fit)") for d in s["decode"])
        pre = s["prefill"]
        lines = [f"{r.layout.name}: batch 1 {s['batch1_ms_per_token']:.2f} ms/token; decode at context "
                 f"{s['decode'][0]['context']:,} by batch: {steps}",
                 f"  prefill of {pre['prompt_len']:,}-token prompts: TTFT {pre['ttft_ms']:.1f} ms alone, "
                 f"{pre['tokens_per_s']:,.0f} prompt tok/s in full steps"]
        if "offline" in s:
            o = s["offline"]
            head = (f"  offline, {o['requests']:,} requests, prompts U{tuple(o['input_len'])}, outputs "
                    f"U{tuple(o['output_len'])}: ")
            if "reason" in o:
                lines.append(head + o["reason"])
            else:
                m = o["per_model_copy"]
                lines.append(head + f"{o['output_tokens_per_s']:,.0f} output tok/s ({m['wall_s']:.1f} s, "
                             f"{m['steps']:,} steps, {m['preemptions']} preemptions"
                             + (f", {r.replicas} model copies" if r.replicas > 1 else "") + ")")
        lines.append(f"  serve: {r.command}")
        for line in lines:
            con.print(line, markup=False, highlight=False)


# ---- scaling -----------------------------------------------------------------------------------------------------
def plan_short(p: Plan) -> str:
    """A plan in a few words: dp replicate x shard, the model-parallel degrees, micro-batch, checkpointing, compile,
    offload."""
    words = [f"{p.dp_replicate}x{p.dp_shard}"]
    words += [f"tp{p.tp}"] if p.tp > 1 else []
    words += [f"pp{p.pp} {_SHORT[p.pp_schedule]}" + (f" v{p.pp_virtual_stages}" if p.pp_virtual_stages > 1 else "")
              ] if p.pp > 1 else []
    words += [f"ep{p.ep}"] if p.ep > 1 else []
    words += [f"mbs {p.micro_batch_size}", f"AC {p.activation_checkpointing}"]
    words += ["compile"] if p.compile else []
    words += ["fp16"] if p.precision == "fp16" else []
    words += ["offload"] if p.cpu_offload else []
    words += ["zero2"] if p.pp == 1 and p.dp_shard > 1 and not p.reshard_after_forward else []
    return " ".join(words)


def scaling_json(model: str, rows: list[ScalingRow], weak: bool = True) -> dict[str, Any]:
    out = []
    for row in rows:
        d: dict[str, Any] = {"gpus": row.gpus, "global_batch_size": row.global_batch_size}
        if row.best is not None:
            d.update(tokens_per_s_per_gpu=round(row.best.tokens_per_s_per_gpu, 1),
                     tokens_per_s=round(row.best.tokens_per_s_per_gpu * row.gpus, 1),
                     mfu=round(row.best.mfu, 4), memory_gib_per_gpu=_gib(row.best.memory.total),
                     scaling_efficiency=round(row.efficiency, 4), plan=plan_dict(row.best, row.result))
            multi_node = row.result.cluster.nodes > 1
            if multi_node:  # which groups cross nodes, at what busbw, and what they leave exposed
                d["cross_node"] = cross_node(row.best, row.result.cluster, row.result.seq_len, row.global_batch_size)
            for name, e, eff in (("flat", row.flat, row.flat_efficiency), ("hsdp", row.hsdp, row.hsdp_efficiency)):
                if e is not None:
                    d[name] = {"plan": plan_short(e.plan), "tokens_per_s_per_gpu": round(e.tokens_per_s_per_gpu, 1),
                               "scaling_efficiency": round(eff, 4), "memory_gib_per_gpu": _gib(e.memory.total),
                               "command": train_command(row.result.model, row.result.cluster, e.plan,
                                                        row.result.seq_len, row.global_batch_size)}
                    if multi_node:
                        d[name]["cross_node"] = cross_node(e, row.result.cluster, row.result.seq_len,
                                                           row.global_batch_size)
            if row.note:
                d["efficiency_note"] = row.note
        else:
            d["reason"] = row.reason
        out.append(d)
    return {"mode": "scaling", "model": model, "kind": "weak" if weak else "strong", "scaling": out}


def print_scaling(model: str, rows: list[ScalingRow], c: Cluster, seq_len: int, gbs: int, weak: bool = True) -> None:
    con = _console()
    kind = (f"weak scaling: {gbs} sequences at {rows[0].gpus} GPUs, the same per GPU at each count" if weak
            else f"strong scaling: global batch {gbs}")
    con.print(f"[bold]{model}[/bold] on {c.gpu.name} ({c.gpus_per_node}/node), seq {seq_len}; {kind}; predicted "
              "(efficiency: tokens/s/GPU against the first count with a plan)", highlight=False)
    for note in c.notes:
        con.print(f"note: {note}", markup=False, highlight=False)
    t = _table("", ("GPUs", "plan", "tok/s/GPU", "MFU", "GiB/GPU", "eff"))
    notes = []
    for r in rows:
        if r.best is None:
            t.add_row(str(r.gpus), "nothing runs (below)", "-", "-", "-", "-")
            notes.append(f"{r.gpus} GPUs: {r.reason}")
            continue
        e = r.best
        t.add_row(str(r.gpus), plan_short(e.plan), f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.mfu:.1%}",
                  f"{e.memory.total / GiB:.1f}" + ("!" if e.tight else ""), f"{r.efficiency:.0%}")
        for label, alt, eff in (("flat", r.flat, r.flat_efficiency), ("HSDP", r.hsdp, r.hsdp_efficiency)):
            if alt is not None and alt is not e:
                t.add_row("", f"{label}: {plan_short(alt.plan)}", f"{alt.tokens_per_s_per_gpu:,.0f}", f"{alt.mfu:.1%}",
                          f"{alt.memory.total / GiB:.1f}" + ("!" if alt.tight else ""), f"{eff:.0%}")
        if r.note:
            notes.append(f"{r.gpus} GPUs: {r.note}")
        if r.result.cluster.nodes > 1:  # what crosses the nodes, and what it leaves exposed
            crossing = [f"{label} ({1e6 / x.tokens_per_s_per_gpu:,.0f} us/token) "
                        f"{cross_node(x, r.result.cluster, seq_len, r.global_batch_size)}"
                        for label, x in (("#1", e), ("flat", r.flat), ("HSDP", r.hsdp))
                        if x is not None and (label == "#1" or x is not e)]
            notes.append(f"{r.gpus} GPUs across nodes: " + " | ".join(crossing))
    con.print(t)
    con.print("plan: dp replicate x shard, tpN, ppN schedule, epN, micro-batch, checkpointing (AC), compile, "
              "offload, zero2 (params kept gathered)", markup=False, highlight=False)
    if any(r.flat is not None or r.hsdp is not None for r in rows):
        con.print("flat: the best plan whose FSDP sharding spans the nodes (its all-gathers and reduce-scatters on the "
                  "NICs); HSDP: the best sharded inside a node and replicated across (only the gradient all-reduce "
                  "crosses nodes)", markup=False, highlight=False)
    if any(r.best is not None and r.best.tight for r in rows):
        con.print(f"!: above the {MEMORY_HEADROOM:.0%} memory headroom (no plan with room fits)", markup=False,
                  highlight=False)
    for n in notes:
        con.print(n, markup=False, highlight=False)


def plot_scaling(rows: list[ScalingRow], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    pts = [(r.gpus, r.best.tokens_per_s_per_gpu, r.efficiency) for r in rows if r.best is not None]
    if not pts:
        raise UserError("--plot: no GPU count in --scaling has a plan that fits, nothing to plot")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs, ys, _ = zip(*pts, strict=True)
    ax.plot(xs, ys, "o-", label="predicted tokens/s/GPU")
    ax.axhline(ys[0], color="gray", ls="--", lw=1, label="linear scaling")
    for x, y, e in pts:
        ax.annotate(f"{e:.0%}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_ylim(0, max(ys) * 1.15)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise UserError(f"--plot {path}: cannot write ({e.strerror})") from None
    finally:
        plt.close(fig)
