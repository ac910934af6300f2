"""The one way paraseek derives random seeds. Every random stream -- a synthetic sequence, an epoch's permutation of
a corpus, a weight tensor at initialization -- has its own generator, seeded from the run's --seed and the stream's
name, so what it draws depends on neither the number of processes nor which of them draws it."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 63-bit generator seed from any tuple: (seed, epoch) and (seed, index) never collide as seed + i would."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
