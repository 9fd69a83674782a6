"""Exception types, one per kind of failure.

Every message names the offending field, tensor or value, so that a user can fix the input
without reading the code.
"""


class ConfigError(ValueError):
    """A model or generation configuration holds an invalid or unsupported value."""


class CheckpointError(ValueError):
    """A checkpoint is malformed: missing, unknown or wrongly shaped tensors, bad files."""


class InputError(ValueError):
    """A call received bad input: token ids out of range, wrong shapes, mismatched caches."""


class SamplingError(ValueError):
    """A sampling step cannot produce a token: NaN logits, or a row with no finite logit."""


class NonFiniteError(SamplingError):
    """A forward pass produced NaN or infinity; the message names the first layer output that was not
    finite and the weight or input that explains it (or says that float32 overflowed)."""
