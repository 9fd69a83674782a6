"""What a conversion did: ``ConversionSummary`` (the report ``diffusiongemma-convert`` prints) and the
default shard size, shared by the transformers and GGUF conversions."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_SHARD_SIZE = 2 * 1024 ** 3  # bytes of tensor data per output file (one bigger tensor may exceed it)


@dataclass(frozen=True)
class ConversionSummary:
    """What ``convert`` did; ``str(summary)`` is the report the command line prints."""

    source: str  # source directory
    destination: str  # output directory
    dtype: str  # storage dtype of the output ("float32" or "bfloat16")
    num_tensors: int  # tensors written
    parameter_count: int  # elements over all written tensors
    source_bytes: dict[str, int]  # bytes read for the written tensors, by source dtype ("BF16", ...)
    output_bytes: dict[str, int]  # bytes written, by storage dtype
    skipped: dict[str, int]  # tensors not written, by group: vision_tower, embed_vision, tied_copies
    files: tuple[str, ...] = ()  # weight files written
    copied: tuple[str, ...] = field(default=())  # side files copied (destination names)

    def __str__(self) -> str:
        lines = [f"converted {self.source} -> {self.destination}",
                 f"  parameters: {self.parameter_count:,} in {self.num_tensors} tensors",
                 "  read:    " + ", ".join(f"{k} {_human(v)}" for k, v in sorted(self.source_bytes.items())),
                 "  written: " + ", ".join(f"{k} {_human(v)}" for k, v in sorted(self.output_bytes.items()))
                 + f" in {len(self.files)} file(s)"]
        skipped = ", ".join(f"{group} {count}" for group, count in sorted(self.skipped.items())) or "none"
        lines.append(f"  skipped: {skipped}")
        if self.copied:
            lines.append("  copied:  " + ", ".join(self.copied))
        return "\n".join(lines)


def _human(n: int) -> str:
    """Bytes as a short human-readable string (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
