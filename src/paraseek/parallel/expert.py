"""Expert parallelism and MoE load balancing, applied from outside the model.

Expert parallelism (GShard, Lepikhin et al. 2020; DeepSeek-V3 report sec. 3.2.2): the routed experts of every MoE
layer are split into `ep` contiguous blocks, rank r of the EP group owning experts [r*E/ep, (r+1)*E/ep). The EP
ranks are data-parallel ranks (each has its own tokens): after the gate, each rank sends every token row to the
rank that owns its expert (all-to-all with variable splits), the owners run their experts as one grouped matmul
over everything they received, and a second all-to-all brings the results back. Attention, the gate and the shared
experts stay data-parallel. Nothing is dropped (no capacity factor), so EP computes exactly what one device does.

The expert weights are DTensors, Shard(0) on the 1-D EP mesh: global shape [E, out, in], local [E/ep, out, in].
Loaders that copy into DTensor local shards (`models.hf.load_state_into`), DCP checkpoints (layout-free) and FSDP2
(`fully_shard(moe.experts, mesh=<dp ranks outside the EP group>)`, which composes the EP placement into a 2-D
sharding) all see the global shape and need nothing EP-specific.

Balancing: DeepSeek-V3's auxiliary-loss-free rule (report sec. 2.1.2: after each step, bias_i += gamma *
sign(mean load - load_i)), V3's complementary sequence-wise balance loss (eqs. 17-20) and DeepSeek-V2's expert-level
balance loss (V2 paper sec. 2.2.3, eqs. 12-14; `seq_aux` as in the hub's modeling_deepseek.py), plus the per-step
load telemetry (tokens per expert, max/mean).

Shape letters: models/deepseek.py's legend (here P is the ranks of the EP group, L their local experts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from paraseek.errors import UserError
from paraseek.models.deepseek import Experts, MoE, grouped_mm


# ---- expert parallelism -----------------------------------------------------------------------------------------------
def _local(w: torch.Tensor) -> torch.Tensor:
    # Differentiable: the gradient of a DTensor parameter arrives as a DTensor with the same placement.
    return w.to_local() if isinstance(w, DTensor) else w


class ExpertParallelExperts(Experts):
    """One MoE layer's routed experts, this rank holding a contiguous block of E/ep of them.

    `forward(x_MD, counts_E)` takes what `Experts.forward` takes -- this rank's slots sorted by (global) expert and
    the slot count of every expert -- and returns the expert outputs for those slots in the same order, so `MoE`
    runs unchanged (and through `__call__`, so FSDP2's unshard hooks on this module fire before the weights are
    read). Parameter names are `Experts`' (gate_proj, up_proj, down_proj): checkpoints don't change."""

    def __init__(self, experts: Experts, ep_mesh: DeviceMesh):
        nn.Module.__init__(self)
        self.ep_mesh = ep_mesh
        self.ep_size, self.ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
        n_experts = experts.gate_proj.shape[0]
        self.n_local = n_experts // self.ep_size
        lo = self.ep_rank * self.n_local
        for name in ("gate_proj", "up_proj", "down_proj"):
            full = getattr(experts, name)
            if isinstance(full, DTensor):
                raise ValueError("apply_expert_parallel must run before FSDP/TP (on the plain, meta-device model)")
            local = full.detach()[lo:lo + self.n_local]
            if not local.is_meta:
                local = local.clone()  # own storage: the other ranks' experts are freed with the full tensor
            param = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(self, name, nn.Parameter(param, requires_grad=full.requires_grad))

    def forward(self, x_MD: torch.Tensor, counts_E: torch.Tensor, use_grouped: bool | None = None) -> torch.Tensor:
        P, L = self.ep_size, self.n_local
        group = self.ep_mesh.get_group()
        # 1. Slot counts: rank s learns how many rows every rank sends to each of its L experts.
        send_PL = counts_E.view(P, L)
        recv_PL = torch.empty_like(send_PL)
        dist.all_to_all_single(recv_PL, send_PL, group=group)
        send_P, recv_P = send_PL.sum(1), recv_PL.sum(1)
        splits = torch.cat([send_P, recv_P]).tolist()  # the one host sync: a2a splits are host ints
        send_splits, recv_splits = splits[:P], splits[P:]
        # 2. Rows to their owners. x_MD is sorted by expert, so the rows for rank r are one contiguous run.
        x_recv = all_to_all_single_autograd(x_MD, recv_splits, send_splits, group)
        # 3. Received rows are (source rank, local expert)-major; reorder them expert-major (source order kept within
        # an expert: the rows of one expert are exactly the rows, in the order, that one device would see).
        seg = torch.repeat_interleave(torch.arange(P * L, device=recv_PL.device), recv_PL.flatten(),
                                      output_size=sum(recv_splits))
        order = torch.argsort((seg % L) * P + seg // L, stable=True)
        x_local = x_recv[order]
        # 4. The local experts, as `Experts.forward` computes them: one grouped GEMM per projection (`project`).
        counts_L = recv_PL.sum(0)
        y_local = Experts.forward(self, x_local, counts_L, use_grouped)
        # 5. Back to (source rank)-major order, then to the ranks the rows came from.
        y_recv = torch.empty_like(y_local)
        y_recv[order] = y_local
        return all_to_all_single_autograd(y_recv, send_splits, recv_splits, group)


    def project(self, name: str, x_MI: torch.Tensor, counts_L: torch.Tensor, use_grouped: bool | None) -> torch.Tensor:
        return grouped_mm(x_MI, _local(getattr(self, name)), counts_L, use_grouped, self.fp8)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers in module order (identical on every rank of a data-parallel group)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def routed_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers the forward pass runs: a Transformer's main layers, then those of the MTP modules it trains
    (Transformer.mtp_depth); MTP modules kept as weights only never run."""
    if not hasattr(model, "layers"):
        return moe_layers(model)
    trained = list(getattr(model, "mtp", None) or [])[:getattr(model, "mtp_depth", 0)]
    return moe_layers(model.layers) + [m for module in trained for m in moe_layers(module)]


def apply_expert_parallel(model: nn.Module, ep: DeviceMesh | ProcessGroup) -> None:
    """Shard the routed experts of every MoE layer over the EP group `ep` (a 1-D DeviceMesh, or a ProcessGroup).

    Run it on the model as built (meta device or real), before FSDP2/activation checkpointing/compile. Afterwards:
    `apply_expert_fsdp` (FSDP2 of the experts over the dp ranks outside the EP group) before the per-block
    `fully_shard`; `to_empty` + `init_weights` or `load_state_into` then fill the local shards (DTensor-aware, no
    communication). parallel/mesh.py slices both meshes (ParallelMesh.ep, .expert_dp)."""
    if isinstance(ep, ProcessGroup):
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend(ep) == "nccl" else "cpu"
        ep = DeviceMesh.from_group(ep, device_type, mesh_dim_names=("ep",))
    if ep.ndim != 1:
        raise ValueError(f"the EP mesh must be 1-D, got {ep.ndim}-D {ep.mesh_dim_names}")
    if ep.size() == 1:
        return
    for moe in moe_layers(model):
        if moe.n_experts % ep.size():  # ParallelDims.check refuses it before a run starts
            raise ValueError(f"ep {ep.size()} does not divide the {moe.n_experts} routed experts")
        moe.experts = ExpertParallelExperts(moe.experts, ep)


def apply_expert_fsdp(model: nn.Module, expert_dp_mesh: DeviceMesh, dp_size: int, **fsdp_kwargs) -> None:
    """FSDP2 for the EP-sharded routed experts, over the dp ranks outside the EP group (ParallelMesh.expert_dp,
    possibly of size 1). Call it before the per-block `fully_shard`, which then leaves these parameters alone.

    The all-to-all's backward already sums the EP group's gradient contributions on the owning rank, so the experts'
    gradients are divided by the whole dp size, not by the size of their own FSDP mesh (as TorchTitan does).
    `fsdp_kwargs`: mp_policy, offload_policy, reshard_after_forward, as for the blocks."""
    from torch.distributed.fsdp import fully_shard

    shard_size = expert_dp_mesh.size(expert_dp_mesh.ndim - 1)  # the shard dim is the last (HSDP: replicate first)
    for moe in moe_layers(model):
        if not isinstance(moe.experts, ExpertParallelExperts):
            continue
        fully_shard(moe.experts, mesh=expert_dp_mesh, **fsdp_kwargs)
        moe.experts.set_gradient_divide_factor(float(dp_size))
        if expert_dp_mesh.device_type == "cpu" and shard_size > 1:
            # gloo has no PREMUL_SUM: sum, then divide. Not with a size-1 shard dim: torch 2.13 then divides twice.
            moe.experts.set_force_sum_reduction_for_comms(True)


# ---- load telemetry and V3's auxiliary-loss-free balancing ------------------------------------------------------------
class ExpertLoad:
    """Tokens per expert of every MoE layer, summed over the micro-batches of a step (`observe` after each forward
    or backward; activation checkpointing's recompute reproduces the same routing, so nothing is counted twice) and,
    by `reduce`, over the data-parallel ranks."""

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu"):
        self.layers = routed_layers(model)
        self.n_experts = model.args.n_routed_experts
        self.device = torch.device(device)  # where a stage without MoE layers makes its empty [0, E] load
        self.counts_YE: torch.Tensor | None = None

    @torch.no_grad()
    def observe(self, rows: slice = slice(None), counts: torch.Tensor | None = None) -> None:
        """Add the last forward's counts of layers[rows], or `counts` taken earlier from `snapshot(rows)` (a
        pipeline stage observes only its own layers)."""
        counts = self.snapshot(rows) if counts is None else counts
        if self.counts_YE is None:
            self.counts_YE = torch.zeros((len(self.layers), counts.shape[1]), dtype=counts.dtype, device=counts.device)
        self.counts_YE[rows] += counts

    @torch.no_grad()
    def snapshot(self, rows: slice = slice(None)) -> torch.Tensor:
        return torch.stack([m.tokens_per_expert for m in self.layers[rows]])

    @torch.no_grad()
    def reduce(self, group: ProcessGroup | None = None) -> torch.Tensor:
        """[Y, E] int64 tokens per expert over the whole step (every dp rank of `group`), and start a new step."""
        if self.counts_YE is None and not self.layers:  # a pipeline stage without MoE layers
            return torch.zeros((0, self.n_experts), dtype=torch.int64, device=self.device)
        if self.counts_YE is None:
            raise RuntimeError("ExpertLoad.reduce before any observe()")
        load_YE, self.counts_YE = self.counts_YE, None
        if dist.is_initialized() and (group is None or dist.get_world_size(group) > 1):
            dist.all_reduce(load_YE, group=group)
        return load_YE


def load_stats(load_YE: torch.Tensor) -> dict:
    """Telemetry from [Y, E] tokens per expert: per-layer max/mean (1.0 = perfectly balanced) and the worst layer.
    No capacity factor exists, so no token is ever dropped."""
    load = load_YE.double()
    max_over_mean = (load.amax(1) / load.mean(1).clamp_min(1e-12)).tolist()
    return {
        "expert_load_max_over_mean": max(max_over_mean) if max_over_mean else 1.0,
        "expert_load_max_over_mean_per_layer": max_over_mean,
        "expert_tokens_max": int(load_YE.amax()) if load_YE.numel() else 0,
        "expert_tokens_mean": load.mean().item() if load_YE.numel() else 0.0,
        "tokens_dropped": 0,
    }


@torch.no_grad()
def update_routing_bias(model: nn.Module, gamma: float, group: ProcessGroup | None = None,
                        load_YE: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing (report sec. 2.1.2): after the optimizer step, for every expert,
    bias += gamma * sign(mean load - load): overloaded experts are chosen less, underloaded ones more. The bias only
    enters the top-k choice, never the combine weights.

    `load_YE`: the step's tokens per expert already summed over the dp ranks (`ExpertLoad.reduce`); without it, the
    last forward's counts are all-reduced over `group` (every data-parallel rank: None = the world). Every rank
    applies the same update to the same fp32 bias, so the biases stay identical. Layers without a bias (V2) are
    skipped. Returns the load used."""
    layers = routed_layers(model)
    if load_YE is None:
        load_YE = torch.stack([m.tokens_per_expert for m in layers])
        if dist.is_initialized() and (group is None or dist.get_world_size(group) > 1):
            dist.all_reduce(load_YE, group=group)
    for moe, load_E in zip(layers, load_YE):
        bias = moe.gate.e_score_correction_bias
        if bias is None:
            continue
        load = load_E.to(device=bias.device, dtype=torch.float32)
        bias.add_(torch.sign(load.mean() - load), alpha=gamma)
    return load_YE


# ---- auxiliary balance losses -----------------------------------------------------------------------------------------
def expert_balance_loss(scores_NE: torch.Tensor, idx_NK: torch.Tensor, n_seqs: int, alpha: float, *,
                        per_sequence: bool, normalize_scores: bool) -> torch.Tensor:
    """alpha * sum_i f_i * P_i with f_i = E / (K * T) * (slots routed to expert i) and P_i = mean_t s_{t,i}.

    per_sequence: T is a sequence's length and the loss is averaged over the n_seqs sequences (V3 eqs. 17-20; V2
    with seq_aux); otherwise T is all N tokens of the batch (V2 eqs. 12-14 as the hub code computes them).
    normalize_scores: s' = s / sum_j s_j (V3's sigmoid scores); V2's softmax scores are used as they are.
    f carries no gradient (it counts a top-k choice); the gradient reaches the router through P."""
    N, E = scores_NE.shape
    K = idx_NK.shape[1]
    s_NE = scores_NE / scores_NE.sum(-1, keepdim=True) if normalize_scores else scores_NE
    B = n_seqs if per_sequence else 1
    T = N // B
    slots_BE = torch.zeros(B, E, device=scores_NE.device, dtype=torch.float32)
    slots_BE.scatter_add_(1, idx_NK.reshape(B, T * K), torch.ones(B, T * K, device=scores_NE.device))
    f_BE = slots_BE * (E / (K * T))
    P_BE = s_NE.float().reshape(B, T, E).mean(1)
    return alpha * (f_BE * P_BE).sum(1).mean()


class _AddAuxLoss(torch.autograd.Function):
    """Identity on x whose backward also sends gradient 1 into `aux` (the hub's DeepSeek-V2 AddAuxiliaryLoss): the
    balance loss joins the objective without a loss tensor escaping the forward (safe under activation checkpointing,
    compile and pipeline schedules)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux.dtype, aux.device, aux.requires_grad)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype, device, needs = ctx.aux_meta
        return grad, (torch.ones((), dtype=dtype, device=device) if needs else None)


class BalanceLoss:
    """The MoE hook (`MoE.balance_loss`): computes the balance loss from the gate's scores and choice and attaches
    it, times `scale`, to the layer's output. `value` is the last eager forward's (unscaled) loss, detached, for
    logging (a torch.compile'd block does not update it)."""

    def __init__(self, alpha: float, per_sequence: bool, normalize_scores: bool, scale: float = 1.0):
        self.alpha, self.per_sequence, self.normalize_scores, self.scale = alpha, per_sequence, normalize_scores, scale
        self.value: torch.Tensor | None = None

    def __call__(self, out_ND: torch.Tensor, scores_NE: torch.Tensor, idx_NK: torch.Tensor, n_seqs: int) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return out_ND
        aux = expert_balance_loss(scores_NE, idx_NK, n_seqs, self.alpha, per_sequence=self.per_sequence,
                                  normalize_scores=self.normalize_scores)
        if not torch.compiler.is_compiling():  # a side effect that a compiled, checkpointed block cannot hold
            self.value = aux.detach()
        return _AddAuxLoss.apply(out_ND, aux * self.scale)


def enable_balance_loss(model: nn.Module, alpha: float | None = None, *, scale: float = 1.0) -> float:
    """Turn the auxiliary balance loss on (it is off by default) for every MoE layer; returns the alpha used.

    V3 (noaux_tc): the complementary sequence-wise loss on normalized sigmoid scores; alpha must be given (the report
    uses 1e-4). V2: the expert-level loss, per sequence if the config says seq_aux, alpha defaulting to the config's
    aux_loss_alpha. `scale`: the loss is added once per forward, so with G micro-batches per step pass 1/G to make
    it the micro-batches' mean (as the cross-entropy is). alpha 0 turns it off."""
    layers = moe_layers(model)
    if not layers:
        return 0.0
    args = layers[0].gate.args
    v3 = args.topk_method == "noaux_tc"
    if alpha is None:
        if v3:
            raise UserError("DeepSeek-V3's sequence-wise balance loss needs an explicit alpha (the report uses 1e-4)")
        alpha = args.aux_loss_alpha
    for moe in layers:
        moe.balance_loss = BalanceLoss(alpha, per_sequence=v3 or args.seq_aux, normalize_scores=v3,
                                       scale=scale) if alpha > 0 else None
    return alpha


def balance_loss_value(model: nn.Module) -> float:
    """The sum over MoE layers of the last forward's balance loss (0.0 when off), for logging."""
    hooks = [m.balance_loss for m in moe_layers(model) if m.balance_loss is not None]
    return float(sum(h.value.item() for h in hooks if h.value is not None))
