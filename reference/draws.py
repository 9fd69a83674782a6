"""Where the randomness of generation comes from: one explicit, injectable draw source.

Generation makes exactly three kinds of random draws, always in this order (trap T14):

    for each canvas:
        canvas      (B, C) int64 ids in [0, V)   the initial canvas; drawn even when the caller supplies
                                                 ``decoder_input_ids`` (then it is discarded)
        for each executed denoising step:
            categorical (B, C) int64 ids         one draw per position from that position's distribution
            renoise     (B, C) int64 ids in [0, V)   fresh noise for the positions not accepted

Nothing else is random. A ``DrawSource`` answers those three requests; ``generate`` calls nothing else.

Sources:

* ``SeededDraws(seed)``: the default, reproducible and counter-based:
  ``numpy.random.Generator(numpy.random.Philox(seed))``, with each request mapped to exactly one
  generator call, in the order above:

      canvas       generator.integers(0, V, size=(B, C), dtype=numpy.int64)
      categorical  u = generator.random(size=(B, C), dtype=numpy.float64), then
                   sampling.categorical_from_uniform(probs, u)
      renoise      generator.integers(0, V, size=(B, C), dtype=numpy.int64)

  A fast path reproduces a reference run token for token by making the same calls on a generator built
  the same way (or by using this class) and the same inverse-CDF rule on its own probabilities.
* ``support.replay.ReplayDraws(tape)`` feeds recorded outcomes back (e.g. the ``torch.randint`` /
  ``torch.multinomial`` results of a transformers run) and ``support.replay.RecordingDraws(source)`` keeps
  another source's tape; the peers' own streams are ``variants/draw.py``.

Upstream: ``EntropyBoundSampler.initialize_canvas`` / ``renoise_canvas`` (``torch.randint``) and
``torch.multinomial(probs.view(B*C, V), 1)`` in ``_denoising_step``; torch's global RNG is replaced by an
explicit source.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .sampling import categorical_from_uniform

__all__ = ["DrawSource", "SeededDraws", "DRAW_KINDS"]

DRAW_KINDS = ("canvas", "categorical", "renoise")


class DrawSource:
    """Interface of a draw source. Subclasses implement the three requests below.

    Every method returns a new (B, C) int64 array.
    """

    takes_logits = False  # True: ``categorical(probs, logits=)`` wants the processed logits too (JAX's Gumbel-max)

    def canvas_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        """The initial canvas of a block: (B, C) ids, uniform over [0, V)."""
        raise NotImplementedError

    def categorical(self, probs: np.ndarray) -> np.ndarray:
        """One id per position drawn from ``probs`` (B, C, V) float32 (each row sums to ~1). -> (B, C)."""
        raise NotImplementedError

    def renoise_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        """Fresh noise for one step: (B, C) ids, uniform over [0, V)."""
        raise NotImplementedError

    def categorical_uniforms(self, batch_size: int, canvas_length: int) -> np.ndarray | None:
        """The (B, C) float64 uniforms of the next categorical draw, for a source that draws by the
        inverse-CDF rule (``sampling.categorical_from_uniform``) and does not need the probabilities: a fast
        path then applies the same rule to its own arrays. None (the default) means this source must be
        handed the probabilities through ``categorical``. Asking consumes the draw, as ``categorical`` does."""
        return None


class SeededDraws(DrawSource):
    """The default source: ``numpy.random.Generator(numpy.random.Philox(seed))``, one call per request.

    seed: anything ``numpy.random.Philox`` accepts (an int, a ``SeedSequence``). Two instances with the
    same seed produce the same draws for the same sequence of requests. See the module docstring for the
    exact calls.
    """

    def __init__(self, seed: int | np.random.SeedSequence = 0):
        self.seed = seed
        self.generator = np.random.Generator(np.random.Philox(seed))

    def canvas_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        return self.generator.integers(0, vocab_size, size=(batch_size, canvas_length), dtype=np.int64)

    def categorical(self, probs: np.ndarray) -> np.ndarray:
        B, C = np.shape(probs)[:-1]
        return categorical_from_uniform(probs, self.categorical_uniforms(B, C))

    def categorical_uniforms(self, batch_size: int, canvas_length: int) -> np.ndarray:
        return self.generator.random(size=(batch_size, canvas_length), dtype=np.float64)  # (B, C) in [0, 1)

    def renoise_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        return self.generator.integers(0, vocab_size, size=(batch_size, canvas_length), dtype=np.int64)


