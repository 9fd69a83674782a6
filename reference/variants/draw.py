"""Draw stages: the token each position proposes in a denoising step.

The spec (``CATEGORICAL``) draws from the run's draw source; mlx-vlm at temperature 0 and diffusers'
BlockRefinement at temperature 0 propose the argmax and draw nothing. The peers' own random streams
(llama.cpp's mt19937, JAX's threefry) are draw sources in this package's ``*_draws`` modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..stages import CategoricalDraw


@dataclass(frozen=True)
class ArgmaxDraw:
    """The argmax draft itself (temperature 0): no random draw is made."""

    name: ClassVar[str] = "argmax"
    source: ClassVar[str] = "mlx-vlm at temperature 0 (its default); diffusers BlockRefinement at temperature 0"

    def __call__(self, draws: Any, probs: np.ndarray, draft: np.ndarray, logits: np.ndarray | None = None) -> np.ndarray:
        return draft


CATEGORICAL, ARGMAX = CategoricalDraw(), ArgmaxDraw()
DRAWS = {s.name: s for s in (CATEGORICAL, ARGMAX)}
