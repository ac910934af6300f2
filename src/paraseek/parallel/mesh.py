"""The run's one named DeviceMesh, built from ParallelDims, and every group sliced from it, once.

The dims and their order are ParallelDims.mesh_shape's (parallel/dims.py says why: pp outermost, tp innermost). With
expert parallelism dp_shard is built as (dp_shard_mod_ep, ep) -- an EP group is `ep` consecutive dp_shard ranks --
and flattened back into "dp_shard" for FSDP2 (DeviceMesh._flatten: in torch 2.11 and 2.13 alike). Nothing else in
the engine derives ranks or groups: the loop, the pipeline, FSDP2/DDP, expert parallelism and the export ask here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paraseek.parallel.dims import ParallelDims


class ParallelMesh:
    """The mesh and its sub-meshes: `fsdp` (dp_shard, or (dp_replicate, dp_shard) for HSDP), `dp_replicate`
    (DDP's group), `dp_shard`, `tp`, `ep` and `expert_dp` (the dp ranks outside an EP group, which hold the same
    experts), `pp`; None where that degree is 1 (the dp dims always exist: FSDP2 runs on a 1-rank mesh too)."""

    def __init__(self, dims: ParallelDims, device_type: str):
        names, sizes = zip(*dims.mesh_shape())
        self.dims, self.device_type = dims, device_type
        self.mesh: DeviceMesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        mesh = self.mesh
        if dims.ep > 1:
            mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        self.dp_replicate, self.dp_shard = mesh["dp_replicate"], mesh["dp_shard"]
        self.fsdp = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else self.dp_shard
        self.tp = mesh["tp"] if dims.tp > 1 else None
        self.ep = mesh["ep"] if dims.ep > 1 else None
        self.expert_dp = None
        if dims.ep > 1:
            self.expert_dp = (mesh["dp_replicate", "dp_shard_mod_ep"] if dims.dp_replicate > 1
                              else mesh["dp_shard_mod_ep"])
        self.pp = mesh["pp"] if dims.pp > 1 else None
        # Pipelined: the ranks of this pp coordinate (one stage's dp x tp ranks; the expert-load sums run over them)
        # and the first rank of every stage (an export gathers each stage onto it, then onto rank 0).
        self.stage_group: dist.ProcessGroup | None = None
        self.stage_leaders: list[int] | None = None
        if self.pp is not None:
            self.stage_group = mesh[tuple(n for n in names if n != "pp")]._flatten("stage").get_group()
            self.stage_leaders = [int(mesh.mesh[s].flatten()[0]) for s in range(dims.pp)]

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel coordinate: which share of every global batch it reads."""
        return self.dp_replicate.get_local_rank() * self.dims.dp_shard + self.dp_shard.get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.pp.get_local_rank() if self.pp is not None else 0

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.pp.get_group() if self.pp is not None else None

    def dp_sum(self, n: int) -> int:
        """The sum over the data-parallel ranks of a count that the tp and pp ranks of each dp rank hold alike (the
        step's trained tokens: they read the same data). One all-reduce over the world, divided by tp x pp."""
        t = torch.tensor([n], dtype=torch.int64, device=self.device_type)
        dist.all_reduce(t)
        return int(t.item()) // (self.dims.tp * self.dims.pp)

    def mean_loss(self, loss_sum: torch.Tensor) -> float:
        """The step's loss, the same on every rank, from each rank's sum of its normalized micro-batch losses: a
        dp rank's value is held alike by its tp ranks, and only on the last pipeline stage (0 elsewhere), so the
        world's sum counts each dp rank tp times. One all-reduce."""
        dist.all_reduce(loss_sum)
        return loss_sum.item() / (self.dims.dp * self.dims.tp)
