"""Baseline for the engine's throughput: HF transformers `generate` on the same requests `paraseek bench-infer`
draws (bench.infer.sample_requests with the same seed), as a user batches them: consecutive chunks of --batch
requests, left-padded, each chunk generating until its longest requested output (min = max new tokens, so no
request stops early; only each request's own requested tokens are counted as output). Random bf16 weights from the
preset's hub config, SDPA attention, greedy.

  python scripts/gpu/hf_requests_baseline.py --preset deepseek-r1-distill-llama-8b --batch 64 --requests 128 \
      [--mode dynamic|static] [--input-len 64:1024 --output-len 64:512 --seed 0 --total 1000]
  python scripts/gpu/hf_requests_baseline.py --preset deepseek-v2-lite --batch 64 --fixed 2048:128   # decode rate

--requests K takes the first K of the --total requests (the same list the engine runs): HF's batches are
independent, so its rate on K of them is its rate on all of them (stated beside the result). Prints one HFREQ
JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from paraseek.bench.infer import sample_requests  # noqa: E402
from paraseek.models.args import preset_config  # noqa: E402


class Clock(LogitsProcessor):
    """A CUDA event per logits hand-off: the first follows the prefill, each next one a decode step."""

    def __init__(self):
        self.marks = []

    def __call__(self, input_ids, scores):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.marks.append(e)
        return scores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", required=True)
    ap.add_argument("--layers", type=int, default=0, help="cut to this many layers (0 = all)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--mode", default="dynamic", choices=["dynamic", "static"])
    ap.add_argument("--requests", type=int, default=128, help="the first K requests of the workload")
    ap.add_argument("--total", type=int, default=1000, help="the workload's size (as bench-infer --num-requests)")
    ap.add_argument("--input-len", default="64:1024")
    ap.add_argument("--output-len", default="64:512")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fixed", help="IN:OUT: --batch requests of fixed lengths instead (decode-rate runs)")
    a = ap.parse_args()

    cfg = {k: v for k, v in preset_config(a.preset).items() if k not in ("auto_map", "architectures", "torch_dtype",
                                                                       "quantization_config")}
    if a.layers:
        cfg["num_hidden_layers"] = a.layers
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    build_s = time.perf_counter() - t0
    V = config.vocab_size
    if a.fixed:
        n_in, n_out = (int(x) for x in a.fixed.split(":"))
        g = torch.Generator().manual_seed(a.seed)
        reqs = [(torch.randint(0, V, (n_in,), generator=g).tolist(), n_out) for _ in range(a.batch)]
    else:
        reqs = sample_requests(a.total, a.input_len, a.output_len, V, a.seed)[:a.requests]
    pad = 0
    useful = wall_total = decode_tokens = decode_s = 0.0
    peak = 0.0
    torch.cuda.reset_peak_memory_stats()
    t_all = time.perf_counter()
    for i in range(0, len(reqs), a.batch):
        chunk = reqs[i:i + a.batch]
        L = max(len(p) for p, _ in chunk)
        new = max(o for _, o in chunk)
        ids = torch.tensor([[pad] * (L - len(p)) + p for p, _ in chunk], device="cuda")
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p, _ in chunk], device="cuda")
        clock = Clock()
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1, pad_token_id=pad,
                  eos_token_id=None, logits_processor=LogitsProcessorList([clock]))
        if a.mode == "static":
            kw["cache_implementation"] = "static"
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, **kw)
        torch.cuda.synchronize()
        wall_total += time.perf_counter() - t
        useful += sum(o for _, o in chunk)
        if len(clock.marks) > 1:
            decode_s += clock.marks[0].elapsed_time(clock.marks[-1]) / 1e3
            decode_tokens += len(chunk) * (len(clock.marks) - 1)
        peak = max(peak, torch.cuda.max_memory_allocated() / 2**30)
    print("HFREQ " + json.dumps({
        "preset": a.preset, "layers": a.layers or config.num_hidden_layers, "mode": a.mode, "batch": a.batch,
        "requests": len(reqs), "of_total": a.total if not a.fixed else None, "fixed": a.fixed,
        "useful_output_tokens": useful, "wall_s": wall_total, "output_tokens_per_s": useful / wall_total,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None,
        "peak_memory_gib": peak, "build_s": build_s, "total_s": time.perf_counter() - t_all,
        "transformers": transformers.__version__, "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
