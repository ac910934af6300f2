"""The training step's MoE side: per-step expert-load telemetry (over every pipeline stage), DeepSeek-V3's bias
update and the optional balance loss, configured from the run's flags (parallel/expert.py has the mechanisms)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from paraseek.models.deepseek import Transformer
from paraseek.parallel.expert import ExpertLoad, enable_balance_loss, load_stats, routed_layers, update_routing_bias
from paraseek.parallel.mesh import ParallelMesh
from paraseek.train.config import TrainConfig


class ExpertBalance:
    """Built once per run when the model has routed experts; `after_micro_batch` after each plain forward and
    backward, `after_schedule` after a pipeline step, `after_step(skipped)` after the optimizer step (returns the
    load metrics)."""

    def __init__(self, cfg: TrainConfig, inner: Transformer, parts: list[Transformer], stage_ids: list[int],
                 mesh: ParallelMesh, device: torch.device):
        args = inner.args
        self.inner, self.mesh, self.accum = inner, mesh, cfg.grad_accum_steps
        self.load = ExpertLoad(inner, device)  # also on a pipeline stage without MoE layers
        # V3 balances with its routing bias (report sec. 2.1.2, gamma 0.001) and trains without the auxiliary loss
        # by default; V2 with its balance loss (aux_loss_alpha from the config).
        # Not under LoRA: the bias belongs to the frozen base, which the adapters cannot carry (train/validate.py
        # refuses an explicit gamma there).
        v3 = args.topk_method == "noaux_tc"
        self.gamma = cfg.moe_bias_gamma if cfg.moe_bias_gamma >= 0 else (0.001 if v3 and not cfg.lora_rank else 0.0)
        alpha = None if cfg.moe_aux_loss_alpha < 0 else cfg.moe_aux_loss_alpha
        enable_balance_loss(inner, 0.0 if alpha is None and v3 else alpha, scale=1.0 / cfg.grad_accum_steps)
        # Pipelined, a stage's forward runs inside the schedule: snapshot each stage's routing right after its
        # forward (the root module's forward is never recomputed by activation checkpointing). On the first step
        # torch's PipelineStage runs an extra forward to infer the shapes it exchanges (a no-grad forward of zeros in
        # older releases, a real forward + backward in torch 2.13); each stage keeps its last n_microbatches
        # snapshots of the step, which are the real ones.
        self.seen: dict[int, list] = {}  # stage -> [(rows, counts)] of each forward in this step
        if mesh.pp is not None:
            for sid, part in zip(stage_ids, parts):
                rows = [i for i, m in enumerate(self.load.layers) if any(m is x for x in routed_layers(part))]
                if rows:
                    part.register_forward_hook(lambda *_, sid=sid, rows=slice(rows[0], rows[-1] + 1): self.seen
                                               .setdefault(sid, []).append((rows, self.load.snapshot(rows))))

    def after_micro_batch(self) -> None:
        self.load.observe()

    def after_schedule(self) -> None:
        for seen in self.seen.values():
            for rows, counts in seen[-self.accum:]:
                self.load.observe(rows, counts)
        self.seen.clear()

    def after_step(self, skipped: bool) -> dict:
        load_YE = self.load.reduce(self.mesh.stage_group)
        stats = load_stats(self._all_stages(load_YE) if self.mesh.pp is not None else load_YE)
        if self.gamma > 0 and not skipped:
            update_routing_bias(self.inner, self.gamma, load_YE=load_YE)
        return stats

    def _all_stages(self, load_YE: torch.Tensor) -> torch.Tensor:
        """The whole model's [Y, E] expert loads from each pp rank's rows (its stages' MoE layers): every rank fills
        its layers' rows of a zero [Y, E] tensor and the pp group sums them."""
        a, depth = self.inner.args, self.inner.mtp_depth
        # rows: the main MoE layers, then the trained MTP modules' (layer ids n_layers + k, on the last stage)
        moe_ids = [i for i in range(a.n_layers + depth) if a.is_moe_layer(i)]
        held = [int(k) for k in self.inner.layers] + [a.n_layers + k for k in range(min(depth, len(self.inner.mtp)))]
        mine = [moe_ids.index(i) for i in held if i in moe_ids]
        every_YE = torch.zeros((len(moe_ids), a.n_routed_experts), dtype=load_YE.dtype, device=load_YE.device)
        every_YE[mine] = load_YE
        dist.all_reduce(every_YE, group=self.mesh.pp_group)
        return every_YE
