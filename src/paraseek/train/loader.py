"""Each data-parallel rank's micro-batches of every optimizer step, from a dataset's windows (train/dataset.py).

The layout rule that makes 1 process and N processes train on exactly the same tokens, step by step:
  step s consumes the global positions [s*B, (s+1)*B)            (B = global batch size, in sequences)
  dp rank r of dp takes the contiguous slice [r*B/dp, (r+1)*B/dp) of them, cut into micro-batches of m in order
  position p -> sequence perm_e[p % N], e = p // N                 (N sequences, perm_e seeded by (seed, epoch e))
So the union over ranks of a step is the same for every dp size, and one process that accumulates B/m micro-batches
sees the same sequences in the same order. Synthetic data has no epochs: sequence i is drawn from a generator seeded
by (seed, i).
"""

from __future__ import annotations

import torch

from paraseek.errors import UserError
from paraseek.models.loss import IGNORE_INDEX
from paraseek.seeding import derive_seed


class DataLoader:
    """This rank's micro-batches of each optimizer step, following the layout rule at the top of this file. The only
    state is the global position (sequences consumed by all ranks together), so a checkpoint taken with one dp size
    resumes exactly with another."""

    def __init__(self, dataset, *, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, position: int = 0):
        per_step = dp_size * micro_batch_size
        if global_batch_size <= 0 or micro_batch_size <= 0 or global_batch_size % per_step:
            raise UserError(f"--global-batch-size {global_batch_size} is not a multiple of dp size {dp_size} x "
                            f"--micro-batch-size {micro_batch_size} = {per_step}: use a multiple of {per_step}")
        assert 0 <= dp_rank < dp_size, (dp_rank, dp_size)
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = position
        self._perms: dict[int, torch.Tensor] = {}  # epoch -> permutation; a step may straddle two epochs

    def _index(self, position: int) -> int:
        n = self.dataset.num_sequences
        if n is None:
            return position
        epoch = position // n
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(derive_seed(getattr(self.dataset, "seed", 0), "epoch", epoch))
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}  # keep only the previous one
            self._perms[epoch] = torch.randperm(n, generator=g)
        return int(self._perms[epoch][position % n])

    def next_step(self) -> list[tuple[torch.Tensor, ...]]:
        """[(inputs [m, T], labels [m, T])] * (B / m): this rank's B = global batch / dp sequences of one optimizer
        step; (inputs, labels, positions [m, T]) when attention is masked per document."""
        per_rank = self.global_batch_size // self.dp_size
        start = self.position + self.dp_rank * per_rank
        windows = [self.dataset.window(self._index(p)) for p in range(start, start + per_rank)]
        self.position += self.global_batch_size
        return collate(windows, self.micro_batch_size, self.dataset.has_positions)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self._perms = {}


def collate(windows: list, m: int, with_positions: bool) -> list[tuple[torch.Tensor, ...]]:
    """Windows (tokens [W], trained [W] or None, positions [W] or None) as micro-batches of m: inputs, labels
    (IGNORE_INDEX where the token is not trained) and, `with_positions`, the inputs' positions."""
    tokens_BW = torch.stack([t for t, _, _ in windows])
    inputs_BT, labels_BT = tokens_BW[:, :-1].contiguous(), tokens_BW[:, 1:].contiguous()
    if any(trained is not None for _, trained, _ in windows):
        trained_BW = torch.stack([torch.ones(len(t), dtype=torch.bool) if trained is None else trained
                                  for t, trained, _ in windows])
        labels_BT = labels_BT.masked_fill(~trained_BW[:, 1:], IGNORE_INDEX)
    parts = [inputs_BT, labels_BT]
    if with_positions:
        parts.append(torch.stack([torch.arange(len(t)) if p is None else p for t, _, p in windows])[:, :-1].contiguous())
    return [tuple(x[i:i + m] for x in parts) for i in range(0, len(windows), m)]


class EvalLoader:
    """This rank's share of the whole evaluation set, the same on every call: windows in index order, rank r of dp
    taking the r-th of dp contiguous slices, each padded to a multiple of `multiple` micro-batches of m with empty
    windows (no trained token), so that every rank runs the same number of forwards and the loss summed over ranks
    is that of the whole set whatever the layout."""

    def __init__(self, dataset, *, micro_batch_size: int, dp_rank: int, dp_size: int, multiple: int = 1):
        self.dataset, self.m = dataset, micro_batch_size
        n, per_batch = dataset.num_sequences, micro_batch_size * multiple
        self.per_rank = -(-(-(-n // dp_size)) // per_batch) * per_batch
        self.first = dp_rank * self.per_rank

    def batches(self) -> list[tuple[torch.Tensor, ...]]:
        W = self.dataset.seq_len + 1
        empty = (torch.zeros(W, dtype=torch.int64), torch.zeros(W, dtype=torch.bool), torch.arange(W))
        windows = [self.dataset.window(i) if i < self.dataset.num_sequences else empty
                   for i in range(self.first, self.first + self.per_rank)]
        return collate(windows, self.m, self.dataset.has_positions)
