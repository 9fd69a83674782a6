"""Checks of the training-side inputs (``reference/noising.py``): noise draws, lengths and loss inputs."""

from __future__ import annotations

import numpy as np

from .errors import InputError


def check_noise_draws(self) -> None:
    """Refuse ``NoiseDraws`` whose arrays disagree in shape, whose uniforms leave [0, 1) (NaN included) or
    whose replacement ids are negative (``InputError`` naming the field)."""
    B = np.shape(self.u_blk)[0] if np.ndim(self.u_blk) == 1 else None
    if B is None:
        raise InputError(f"u_blk must be 1-D (B,), got shape {np.shape(self.u_blk)}")
    C = np.shape(self.u_cor)[-1] if np.ndim(self.u_cor) == 2 else None
    if C is None:
        raise InputError(f"u_cor must be 2-D (B, C), got shape {np.shape(self.u_cor)}")
    for name, shape in (("u_t", (B, 1)), ("u_cor", (B, C)), ("r", (B, C)), ("u_sc", (B,))):
        if np.shape(getattr(self, name)) != shape:
            raise InputError(f"{name} must have shape {shape}, got {np.shape(getattr(self, name))}")
    for name in ("u_blk", "u_t", "u_cor", "u_sc"):
        u = np.asarray(getattr(self, name))
        if not (np.all(u >= 0) and np.all(u < 1)):  # also rejects NaN
            raise InputError(f"{name} must lie in [0, 1), got values outside: {u[~((u >= 0) & (u < 1))]}")
    if np.any(np.asarray(self.r) < 0):
        raise InputError(f"r holds negative ids: {np.asarray(self.r)[np.asarray(self.r) < 0]}")


def check_int_vector(name: str, v, batch: int | None = None) -> np.ndarray:
    """``v`` as an int64 (B,) array; InputError if it is not 1-D integral of the right length."""
    a = np.asarray(v)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise InputError(f"{name} must be a 1-D integer array, got dtype {a.dtype} shape {a.shape}")
    if batch is not None and a.shape[0] != batch:
        raise InputError(f"{name} must have length {batch}, got {a.shape[0]}")
    return a.astype(np.int64)


def check_loss_inputs(z: np.ndarray, y: np.ndarray) -> None:
    """Refuse logits (..., V) and targets (...) that disagree in shape, non-finite logits or targets outside
    [0, V) (``InputError``)."""
    if z.shape[:-1] != y.shape:
        raise InputError(f"logits shape {z.shape} does not match targets shape {y.shape}")
    if not np.all(np.isfinite(z)):
        raise InputError("logits contain NaN or inf")
    if np.any((y < 0) | (y >= z.shape[-1])):
        raise InputError(f"targets must lie in [0, {z.shape[-1]}), got {y[(y < 0) | (y >= z.shape[-1])]}")


def check_num_canvases(canvas, R) -> None:
    """Refuse the inputs of ``noising.num_canvases`` that it cannot use (``InputError`` naming the value)."""
    if canvas < 1:
        raise InputError(f"canvas length must be >= 1, got {canvas}")
    if np.any(R < 1):
        raise InputError(f"every response needs at least one token, got lengths {R[R < 1].tolist()}")


def check_select_canvas(u, n) -> None:
    """Refuse the inputs of ``noising.select_canvas`` that it cannot use (``InputError`` naming the value)."""
    if u.shape != n.shape:
        raise InputError(f"u_blk shape {u.shape} != n shape {n.shape}")
    if np.any(n < 1):
        raise InputError(f"n must be >= 1, got {n[n < 1].tolist()}")


def check_canvas_targets_1(x) -> None:
    """Refuse the inputs of ``noising.canvas_targets`` that it cannot use (``InputError`` naming the value)."""
    if x.ndim != 2:
        raise InputError(f"x must be 2-D (B, S), got shape {x.shape}")


def check_canvas_targets_2(P, S, R, k, n) -> None:
    """Refuse the inputs of ``noising.canvas_targets`` that it cannot use (``InputError`` naming the value)."""
    if np.any(P < 0) or np.any(P + R > S):
        raise InputError(f"prompt_len + resp_len must fit in S={S}: P={P.tolist()} R={R.tolist()}")
    if np.any((k < 0) | (k >= n)):
        raise InputError(f"canvas index k={k.tolist()} out of range for n={n.tolist()}")


def check_encoder_input_1(x) -> None:
    """Refuse the inputs of ``noising.encoder_input`` that it cannot use (``InputError`` naming the value)."""
    if x.ndim != 2:
        raise InputError(f"x must be 2-D (B, S), got shape {x.shape}")


def check_encoder_input_2(S, P, R) -> None:
    """Refuse the inputs of ``noising.encoder_input`` that it cannot use (``InputError`` naming the value)."""
    if np.any(P + R > S):
        raise InputError(f"prompt_len + resp_len must fit in S={S}: P={P.tolist()} R={R.tolist()}")


def check_time_from_uniform(eps) -> None:
    """Refuse the inputs of ``noising.time_from_uniform`` that it cannot use (``InputError`` naming the value)."""
    if not (0.0 <= eps < 1.0):
        raise InputError(f"eps must lie in [0, 1), got {eps}")


def check_corrupt(y, u, r, t) -> None:
    """Refuse the inputs of ``noising.corrupt`` that it cannot use (``InputError`` naming the value)."""
    if y.ndim != 2 or u.shape != y.shape or r.shape != y.shape:
        raise InputError(f"y, u_cor, r must share one (B, C) shape, got {y.shape}, {u.shape}, {r.shape}")
    if t.shape != (y.shape[0], 1):
        raise InputError(f"t must have shape ({y.shape[0]}, 1), got {t.shape}")


def check_self_conditioning_coin(p) -> None:
    """Refuse the inputs of ``noising.self_conditioning_coin`` that it cannot use (``InputError`` naming the value)."""
    if not (0.0 <= p <= 1.0):
        raise InputError(f"self-conditioning probability must lie in [0, 1], got {p}")


def check_noise_batch(vocab, draws) -> None:
    """Refuse the inputs of ``noising.noise_batch`` that it cannot use (``InputError`` naming the value)."""
    if np.any(np.asarray(draws.r) >= vocab):
        raise InputError(f"replacement ids must be < vocab={vocab}, got max {int(np.max(draws.r))}")


def check_diffusion_loss(ce, logits) -> None:
    """Refuse the inputs of ``noising.diffusion_loss`` that it cannot use (``InputError`` naming the value)."""
    if ce.ndim != 2:
        raise InputError(f"diffusion logits must be (B, C, V), got shape {np.shape(logits)}")


def check_ar_loss_1(v, tok) -> None:
    """Refuse the inputs of ``noising.ar_loss`` that it cannot use (``InputError`` naming the value)."""
    if v.shape != tok.shape or tok.ndim != 2:
        raise InputError(f"tokens {tok.shape} and valid {v.shape} must share one (B, S) shape")


def check_ar_loss_2(pair) -> None:
    """Refuse the inputs of ``noising.ar_loss`` that it cannot use (``InputError`` naming the value)."""
    if not pair.any():
        raise InputError("ar_loss: the batch has no valid next-token pair")
