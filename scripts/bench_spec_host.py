"""The host parts of a speculative step on CPU, in ms of process CPU time per step (steady beside other processes on
a shared machine): drafting, verification rows (the sample rows of
each request's K + 1 positions), the step's int arrays (engine._host_batch), verification and the rest (accepting,
delivering, releasing blocks). The forwards (the target's and the MTP drafter's) are timed apart: on CPU they are
the model's compute, which a GPU does elsewhere.

    PYTHONPATH=src python scripts/bench_spec_host.py [--batches 1,32,128] [--steps 20]

A tiny-moe model (random weights made predictable, one MTP module), 512-token prompts that follow its next-token map
from a random token (a random map's orbit enters a cycle of some tens of tokens: prompt lookup finds drafts), greedy,
ngram K=3 and mtp K=1.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from paraseek.infer import spec
from paraseek.infer.engine import Engine, EngineConfig
from paraseek.infer.sampling import SamplingParams
from paraseek.models import ModelArgs, build_model
from paraseek.models.args import preset_config

PARTS = ("draft", "verify rows", "host batch", "verify", "other", "forward")


class Timer:
    """Seconds per part; a forward inside the drafter counts as forward, not as drafting."""

    def __init__(self):
        self.s: dict[str, float] = defaultdict(float)
        self.inner = 0.0  # forward seconds inside the part being timed

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            inner0, t0 = self.inner, time.process_time()
            try:
                return fn(*a, **k)
            finally:
                dt = time.process_time() - t0
                if name == "forward":
                    self.inner += dt
                    self.s[name] += dt
                else:  # time of its own only (forwards inside excluded)
                    self.s[name] += dt - (self.inner - inner0)
        return timed


@torch.no_grad()
def _predictable(model, D: int):
    """Random weights whose next token is mostly a function of the current one (every block's output projections
    scaled down, as tests/unit/test_speculative.py's predictable models): greedy output falls into cycles that prompt
    lookup finds, and the MTP module (a copy of that map one token on) drafts mostly right."""
    for name, p in model.named_parameters():
        p.copy_(torch.randn_like(p) * (0.2 if "norm" not in name else 0.1) + (1.0 if "norm" in name else 0.0))
    for name, p in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
            p.mul_(0.0 if name.startswith("mtp.") else 0.003)
    m = model.mtp[0]
    m.eh_proj.weight.zero_()
    m.eh_proj.weight[:, :D] = torch.eye(D)
    m.enorm.weight.fill_(1.0)
    m.norm.weight.copy_(model.norm.weight)
    return model


def measure(method: str, k: int, batch: int, steps: int, prompt_len: int = 512) -> dict[str, float]:
    args = ModelArgs.from_hf_config(preset_config("tiny-moe") | {"num_nextn_predict_layers": 1,
                                                                 "max_position_embeddings": 2048})
    torch.manual_seed(0)
    model = _predictable(build_model(args, "cpu", torch.float32).eval(), args.dim)
    with torch.no_grad():  # the map each token's next token mostly follows
        next_token = model(torch.arange(args.vocab_size)[:, None])[:, -1].argmax(-1).tolist()
    bs, out_len = 16, steps * (k + 1) + 8
    blocks = batch * ((prompt_len + out_len + k) // bs + 2) + 1
    cfg = dict(block_size=bs, num_kv_blocks=blocks, max_num_seqs=batch,
               max_batched_tokens=max(batch * (k + 1), prompt_len * 8), speculative=method,
               num_speculative_tokens=k)
    if method == "ngram":  # a random model's tokens rarely continue a longer n-gram: single tokens are looked up too
        cfg["ngram_min"] = 1
    if "speculative_max_batch" in EngineConfig.__dataclass_fields__:  # speculate at every batch size
        cfg["speculative_max_batch"] = batch
    engine = Engine(model, EngineConfig(**cfg), log=lambda *_: None)
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    for i in range(batch):
        chain = [int(torch.randint(3, args.vocab_size, (), generator=g))]
        while len(chain) < prompt_len:
            chain.append(next_token[chain[-1]])
        engine.add_request(f"r{i}", chain, params)
    while any(r.num_computed < r.num_prompt for r in engine.requests.values()):  # the prefill, untimed
        engine.step()
    t = Timer()
    engine._forward = t.wrap("forward", engine._forward)
    engine.drafter.propose = t.wrap("draft", engine.drafter.propose)
    engine._host_batch = t.wrap("host batch", engine._host_batch)
    engine._sample_row = t.wrap("verify rows", engine._sample_row)
    engine.runner.greedy = t.wrap("verify", engine.runner.greedy)  # the argmax greedy verification reads
    saved = spec.verify, spec.verify_rows, getattr(spec, "verify_greedy", None)  # (absent before the argmax path)
    spec.verify = t.wrap("verify", spec.verify)
    spec.verify_greedy = saved[2] and t.wrap("verify", saved[2])
    spec.verify_rows = t.wrap("verify rows", spec.verify_rows)
    generated0, drafted0 = engine.num_generated, engine.drafter.stats.num_draft_tokens
    try:
        t0 = time.process_time()
        for _ in range(steps):
            engine.step()
        total = time.process_time() - t0
    finally:
        spec.verify, spec.verify_rows, spec.verify_greedy = saved
    out = {name: 1e3 * v / steps for name, v in t.s.items()}
    out["total"] = 1e3 * total / steps
    out["other"] = out["total"] - sum(out.get(p, 0.0) for p in PARTS if p != "other")
    out["tokens/step"] = (engine.num_generated - generated0) / steps / batch
    out["drafts/step"] = (engine.drafter.stats.num_draft_tokens - drafted0) / steps / batch
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--steps", type=int, default=20)
    ns = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'drafter':<8} {'batch':>5} " + " ".join(f"{p:>11}" for p in PARTS)
          + f" {'host total':>11} {'tokens/req':>11} {'drafts/req':>11}")
    for method, k in (("ngram", 3), ("mtp", 1)):
        for batch in map(int, ns.batches.split(",")):
            r = measure(method, k, batch, ns.steps)
            host = r["total"] - r["forward"]
            print(f"{method + ' K=' + str(k):<8} {batch:>5} " + " ".join(f"{r.get(p, 0.0):>11.2f}" for p in PARTS)
                  + f" {host:>11.2f} {r['tokens/step']:>11.2f} {r['drafts/step']:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
