"""Golden traces: record every intermediate of a generation run, store it in a versioned file, and find
the first tensor at which two runs part.

    format.py    tensor names, the JSON header, ``write_trace`` and the reader ``Trace`` (docs/TRACE_FORMAT.md)
    recorder.py  ``TraceRecorder``: the observer a generation run calls at its named points
    compare.py   ``compare_traces`` and ``format_report``: the first divergence between two traces

The trace package sits beside the specification, not inside it: ``reference.generate`` calls an observer
(``reference.observer.Observer``) at named points of the loop, and ``TraceRecorder`` is one such observer.
"""

from .compare import Comparison, Row, compare_traces, format_report
from .format import (DEFAULT_ATOL, DEFAULT_RTOL, DEFAULT_TOP_K, FORMAT_NAME, FORMAT_VERSION, METADATA_KEY, Trace, TraceError,
                     write_trace)
from .recorder import TraceRecorder, config_hash, layers_by_default, record_generate, summarize_logits

__all__ = [
    "TraceError", "TraceRecorder", "Trace", "Comparison", "Row", "compare_traces", "format_report",
    "record_generate", "summarize_logits", "config_hash", "write_trace", "layers_by_default",
    "FORMAT_NAME", "FORMAT_VERSION", "METADATA_KEY", "DEFAULT_ATOL", "DEFAULT_RTOL", "DEFAULT_TOP_K",
]
