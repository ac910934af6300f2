"""What torch.compile'd blocks keep for backward, against planner/memory.py's compiled_layer_activation_bytes.

    PYTHONPATH=src python scripts/planner/compiled_activations.py      # CPU, a few minutes (inductor's C++ backend)

Builds tiny models (tiny-dense with head_dim 24, so that the q, kv and model widths differ; tiny-moe with
v_head_dim 24), applies the engine's checkpointing and per-block compile (parallel/parallelize.py), and measures the
bytes per token each block saves with saved_tensors_hooks (live tensors only, parameters and cos/sin excluded, the
slope between 64 and 128 tokens), as tests/unit/test_planner.py does for eager blocks. Selective checkpointing keeps
its tensors out of the hooks' sight in eager mode, so only the compiled selective blocks are measured.
Known difference: the MoE layer on the CPU runs the per-expert loop (not the grouped GEMM of Hopper GPUs), whose
compiled graph keeps one more copy of the gathered rows and of an expert-width buffer (384 B/token here); the formula
prices the grouped-GEMM path. The compiled selective MoE block keeps only its input here (its checkpointed region
is not traced into the block's graph on the CPU), so it is not compared.
"""

from __future__ import annotations

import weakref

import torch
import torch._dynamo

from paraseek.models import build_model, resolve_model
from paraseek.parallel.parallelize import apply_activation_checkpointing, apply_compile
from paraseek.planner.memory import compiled_layer_activation_bytes

torch._dynamo.config.automatic_dynamic_shapes = False  # one static graph per length: no dynamic-shape codegen
torch._dynamo.config.cache_size_limit = 64


def saved_bytes_per_token(args, ac: str, layers: list[int]) -> list[float]:
    torch.manual_seed(0)
    m = build_model(args, "cpu", torch.bfloat16)
    apply_activation_checkpointing(m, ac)
    apply_compile(m)
    out = []
    for i in layers:
        block = list(m.layers.values())[i]
        sizes = []
        for T in (64, 128):
            x = torch.randn(2, T, args.dim, dtype=torch.bfloat16, requires_grad=True)
            cos, sin = (c.to(torch.bfloat16) for c in m.rope_cos_sin(T, x.device))
            skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
            skip |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
            refs = []

            def pack(t, refs=refs):
                refs.append(weakref.ref(t))
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = block(x, cos, sin)
            live = {r().untyped_storage().data_ptr(): r().untyped_storage().nbytes() for r in refs
                    if r() is not None and r().untyped_storage().data_ptr() not in skip}
            sizes.append(sum(live.values()))
            del y
        out.append((sizes[1] - sizes[0]) / (2 * 64))
    return out


CASES = [("tiny-dense", {"head_dim": 24}, "none", [0]), ("tiny-dense", {"head_dim": 24}, "selective", [0]),
         ("tiny-moe", {"v_head_dim": 24}, "none", [0, 1]), ("tiny-moe", {"v_head_dim": 24}, "selective", [0])]

if __name__ == "__main__":
    for name, changes, ac, layers in CASES:
        a = resolve_model(name)[0].replace(**changes)
        measured = saved_bytes_per_token(a, ac, layers)
        predicted = [sum(compiled_layer_activation_bytes(a, i, ac)) for i in layers]
        print(f"{name} {changes} {ac}: measured {measured}, formula {predicted} bytes per token per layer")
