"""Replaying the random draws of PyTorch's seeded CPU generator in NumPy (an oracle for the tests).

A NumPy reference and a PyTorch training step consume identical randomness when the NumPy side replays
what ``torch.Generator().manual_seed(seed)`` draws (TRAINING.md §8.2). This is how the training objective
(``reference.noising``) is checked against a real torch step without sharing any code with torch.
"""

from __future__ import annotations

import numpy as np

from diffusiongemma.reference.support.errors import InputError
from diffusiongemma.reference.noising import NoiseDraws

__all__ = ["TorchCPUGenerator"]


class TorchCPUGenerator:
    """Replays the draws of ``torch.Generator().manual_seed(seed)`` (CPU) in NumPy.

    torch's CPU generator is MT19937 seeded with the reference ``init_genrand(seed)``; for the draws used
    here every element consumes one 32-bit output w, in row-major order (TRAINING.md §8.2, checked
    against torch 2.13):

    * ``rand``: float32((w & 0xFFFFFF) * 2**-24), i.e. 24 random bits, values in [0, 1 - 2**-24];
    * ``randint(high)``: w mod high for 1 <= high < 2**28; for 2**28 <= high < 2**32 torch draws 64 bits
      per element from two outputs (w_first << 32 | w_second) and takes that mod high.

    Not valid for CUDA generators (Philox) or for other torch distributions.
    seed: int in [0, 2**32). Raises InputError otherwise.
    """

    def __init__(self, seed: int):
        if not (isinstance(seed, (int, np.integer)) and 0 <= int(seed) < 2**32):
            raise InputError(f"seed must be an int in [0, 2**32), got {seed!r}")
        legacy = np.random.RandomState(int(seed))  # init_genrand(seed), the same seeding as torch
        self._bits = np.random.MT19937()
        self._bits.state = legacy.get_state(legacy=False)

    def _raw(self, shape: tuple) -> np.ndarray:
        """``prod(shape)`` raw 32-bit outputs as uint64, reshaped to ``shape``."""
        n = int(np.prod(shape, dtype=np.int64))
        return self._bits.random_raw(n).reshape(shape)

    def rand(self, *shape: int) -> np.ndarray:
        """Like ``torch.rand(*shape, generator=g)``: float32 array of ``shape`` in [0, 1)."""
        return ((self._raw(shape) & 0xFFFFFF).astype(np.float64) * 2.0**-24).astype(np.float32)

    def randint(self, high: int, shape: tuple) -> np.ndarray:
        """Like ``torch.randint(high, shape, generator=g)``: int64 array in [0, high)."""
        if not (isinstance(high, (int, np.integer)) and 1 <= int(high) < 2**32):
            raise InputError(f"randint high must be an int in [1, 2**32), got {high!r}")
        shape = tuple(shape)
        if high < 2**28:  # one 32-bit output per element
            return (self._raw(shape) % np.uint64(high)).astype(np.int64)
        w = self._raw(shape + (2,))  # torch takes a 64-bit draw: first output is the high word
        return (((w[..., 0] << np.uint64(32)) | w[..., 1]) % np.uint64(high)).astype(np.int64)

    def training_draws(self, batch: int, canvas: int, vocab: int) -> NoiseDraws:
        """One step's draws in TRL's order: rand(B), rand(B, 1), rand(B, C), randint(V, (B, C)),
        rand(B). Matches ``examples/train_tiny.draw_noise`` on a torch generator of the same seed."""
        for name, v in (("batch", batch), ("canvas", canvas), ("vocab", vocab)):
            if not (isinstance(v, (int, np.integer)) and v >= 1):
                raise InputError(f"{name} must be a positive int, got {v!r}")
        u_blk = self.rand(batch)
        u_t = self.rand(batch, 1)
        u_cor = self.rand(batch, canvas)
        r = self.randint(vocab, (batch, canvas))
        u_sc = self.rand(batch)
        return NoiseDraws(u_blk=u_blk, u_t=u_t, u_cor=u_cor, r=r, u_sc=u_sc)
