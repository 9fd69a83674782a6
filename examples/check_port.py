"""A port checking itself against the stored golden traces, without torch or transformers.

    python examples/check_port.py                              # every case in tests/golden, all three modes
    python examples/check_port.py --case tiny-a --mode forward
    python examples/check_port.py --perturb layers.2.k_proj    # a broken port: exits 1, naming the tensor

The "port" here is the NumPy reference (``diffusiongemma.reference``), used the way a port in another
language would be, in each of the three ways a golden trace can be used (docs/TRACE_FORMAT.md, "Golden
traces"):

* ``forward``: only the model. Teacher-forced from the golden inputs (prompt, mask, each step's input canvas,
  the previous step's logits and temperature for self-conditioning, the committed canvases), it computes the
  encoder's K/V, the decoder input, the layer outputs and the logits, and writes them with ``write_trace_plain``
  below: plain Python (``struct`` and ``json``), the recipe any language can follow;
* ``sampler``: only the loop. The golden logits stand in for the model and the golden draws are replayed; it
  computes temperatures, drafts, entropies, acceptance, renoised canvases, stopping, commits and the output
  (recorded with the library's ``TraceRecorder``, the route for a port written in Python);
* ``all``: the whole loop, replaying the golden draws.

Each result goes through ``diffusiongemma compare GOLDEN PORT --only MODE`` (run as a command, as a port's CI
would). Exit status: 0 when every check agrees, 1 when one differs (the report names the first tensor), 2 when
the files cannot be used.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_DIR = os.path.join(os.path.dirname(HERE), "tests", "golden")
MODES = ("forward", "sampler", "all")


# ================================================================================================ the writer
_CODES = {"F32": ("<f", 4), "I64": ("<q", 8), "BOOL": ("<?", 1)}


def write_trace_plain(path: str, header: dict, tensors: list[tuple[str, str, list[int], list]]) -> None:
    """Write a trace file with the standard library only.

    header: the trace header (docs/TRACE_FORMAT.md), without "tensors" (filled in here from ``tensors``).
    tensors: in run order, ``(name, group_and_kind, shape, flat values)`` where ``group_and_kind`` is
    ``"group/kind"`` (e.g. ``"logits/float"``) and the values are row-major Python numbers. Floats are stored
    as F32, "exact" tensors as I64 (bool masks as BOOL when the name is a mask). ``draws.{n}`` entries, if
    any, go in after the run order.

    The file: 8-byte little-endian header length N, N bytes of JSON (the safetensors header, whose
    ``__metadata__`` holds the trace header as a string), then each tensor's little-endian bytes.
    """
    order, index, blobs, offset = [], {}, [], 0
    for name, group_kind, shape, values in tensors:
        group, kind = group_kind.split("/")
        if not name.startswith("draws."):
            order.append({"name": name, "group": group, "kind": kind})
        code = "F32" if kind == "float" else "BOOL" if name.endswith((".accepted", ".finished", ".ended")) else "I64"
        fmt, size = _CODES[code]
        count = 1
        for n in shape:
            count *= n
        if len(values) != count:
            raise ValueError(f"{name}: {len(values)} values for shape {shape}")
        blob = struct.pack(f"<{count}{fmt[1]}", *values)
        index[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header = dict(header, tensors=order)
    meta = json.dumps({"__metadata__": {"diffusiongemma.trace": json.dumps(header)}, **index}).encode()
    meta += b" " * (-len(meta) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(meta)))
        f.write(meta)
        for blob in blobs:
            f.write(blob)


# ================================================================================================ the port
def load_case(case_dir: str):
    """(golden Trace, model directory) of a case in tests/golden."""
    from diffusiongemma.checkpoint import default_model_dir
    from diffusiongemma.trace import Trace

    with open(os.path.join(case_dir, "case.json"), encoding="utf-8") as f:
        info = json.load(f)
    model_dir = os.path.join(case_dir, "model") if info["model"] == "model" else default_model_dir()
    return Trace(os.path.join(case_dir, "golden.trace")), model_dir


def _flat(array) -> list:
    return array.ravel().tolist()


def run_forward(golden, model, out_path: str) -> None:
    """Teacher-forced forward passes on the golden inputs, written with ``write_trace_plain``."""
    import numpy as np

    from diffusiongemma.reference.support.observer import Observer

    names = set(golden.names)
    ids = golden.get("prompt.input_ids")
    mask = golden.get("prompt.attention_mask") if "prompt.attention_mask" in names else None
    B, C, L = ids.shape[0], model.config.canvas_length, model.config.num_hidden_layers
    out: list = [("prompt.input_ids", "prompt/exact", list(ids.shape), _flat(ids))]
    if mask is not None:
        out.append(("prompt.attention_mask", "prompt/exact", list(mask.shape), _flat(mask)))

    class Taps(Observer):  # the reference's observer points: decoder input and layer outputs
        def __init__(self):
            self.h = {}

        def decoder_input(self, h, rows=None):
            self.h["input_embedding"] = np.array(h)

        def decoder_layer(self, layer, h, rows=None):
            self.h[f"layer{layer}.output"] = np.array(h)

    cache = model.new_cache(B)
    new_ids, new_mask, e, k = ids, mask, 0, 0
    while True:
        model.encode(new_ids, cache, new_mask)  # encoder call e
        n = new_ids.shape[1]
        real = np.ones((B, n), bool) if new_mask is None else new_mask.astype(bool)
        for l in range(L):
            keys, values = cache.keys[l], cache.values[l]
            T = keys.shape[2]
            m = min(n, T)
            keep = real[:, n - m:][:, None, :, None]  # padding positions are written as 0
            for what, x in (("keys", keys), ("values", values)):
                x = np.where(keep, x[:, :, T - m:], 0).astype(np.float32)
                out.append((f"encode{e}.layer{l}.{what}", "encoder_kv/float", list(x.shape), _flat(x)))
            out.append((f"encode{e}.layer{l}.cached", "encoder_kv/exact", [], [T]))
        if f"canvas{k}.initial" not in names:
            break
        frozen = np.zeros(B, bool)
        i, canvas, sc = 0, golden.get(f"canvas{k}.initial"), None
        while f"canvas{k}.step{i}.logits" in names:
            taps = Taps()
            logits = model.denoise(canvas, cache, sc, observer=taps)
            for what, x in (*taps.h.items(), ("logits", logits)):
                x = np.where(frozen[:, None, None], 0, x).astype(np.float32)  # frozen rows: written as 0
                group = {"input_embedding": "input_embedding", "logits": "logits"}.get(what, "layer_output")
                out.append((f"canvas{k}.step{i}.{what}", f"{group}/float", list(x.shape), _flat(x)))
            # the next step's inputs come from the golden run (teacher forcing)
            golden_logits = golden.get(f"canvas{k}.step{i}.logits")
            t = f"canvas{k}.step{i}.temperature"
            sc = golden_logits / golden.get(t) if t in names else golden_logits.copy()
            canvas = golden.get(f"canvas{k}.step{i}.canvas")
            frozen = golden.get(f"canvas{k}.step{i}.finished").astype(bool)
            i += 1
        if f"encode{e + 1}.layer0.keys" not in names:
            break
        new_ids = golden.get(f"canvas{k}.committed")
        new_mask = None if mask is None else np.ones((B, C), dtype=np.int64)
        e, k = e + 1, k + 1
    header = {"format": "diffusiongemma-trace", "version": 1, "producer": "check_port.py forward (plain writer)",
              "model": {key: golden.header["model"][key] for key in
                        ("config_hash", "vocab_size", "canvas_length", "hidden_size", "num_hidden_layers")},
              "generation": golden.header.get("generation", {}),
              "draws": {"source": "golden inputs", "seed": None, "tape": None},
              "logits": {"mode": "full", "top_k": None}}
    write_trace_plain(out_path, header, out)


class _LogitsOnly:
    """A stand-in model for a sampler-only port: the golden logits, in step order; no weights."""

    def __init__(self, golden, config):
        self.config = config
        self._logits = [golden.get(n) for n in golden.names if n.endswith(".logits")]

    def new_cache(self, batch_size):
        class Positions:  # generate needs only the number of positions encoded so far
            length = 0

        cache = Positions()
        cache.batch_size = batch_size
        return cache

    def encode(self, ids, cache, mask=None):
        cache.length += ids.shape[1]

    def denoise(self, canvas, cache, sc_logits=None):
        return self._logits.pop(0)


def run_loop(golden, model, out_path: str) -> None:
    """The generation loop replaying the golden draws, recorded by the library's TraceRecorder."""
    from diffusiongemma.reference.support.replay import ReplayDraws
    from diffusiongemma.reference.generate import generate
    from diffusiongemma.reference.generation_config import GenerationConfig
    from diffusiongemma.trace import TraceRecorder

    ids = golden.get("prompt.input_ids")
    mask = golden.get("prompt.attention_mask") if "prompt.attention_mask" in golden.names else None
    draws = ReplayDraws(golden.draw_tape())
    recorder = TraceRecorder(layers=True, producer=f"check_port.py ({type(model).__name__})")
    generate(model, ids, mask, generation_config=GenerationConfig.from_dict(golden.header["generation"]),
             random=draws, trace=recorder)
    draws.check_exhausted()
    recorder.save(out_path)


def check(case_dir: str, mode: str, workdir: str, perturb: str | None = None) -> int:
    """Run the port on one case in one mode and compare; returns compare's exit status."""
    import numpy as np

    from diffusiongemma.reference.model import Model

    golden, model_dir = load_case(case_dir)
    with golden:
        model = Model.from_pretrained(model_dir)
        if perturb:
            tensors = dict(model.tensors)
            noise = np.random.default_rng(0).standard_normal(tensors[perturb].shape).astype(np.float32)
            tensors[perturb] = tensors[perturb] + np.float32(0.02) * noise
            model = Model(model.config, tensors)
        out_path = os.path.join(workdir, f"{os.path.basename(case_dir)}-{mode}.trace")
        if mode == "forward":
            run_forward(golden, model, out_path)
        elif mode == "sampler":
            run_loop(golden, _LogitsOnly(golden, model.config), out_path)
        else:
            run_loop(golden, model, out_path)
    command = [sys.executable, "-m", "diffusiongemma", "compare", golden.path, out_path, "--only", mode, "--summary"]
    result = subprocess.run(command, capture_output=True, text=True)
    status = "agrees" if result.returncode == 0 else "DIFFERS" if result.returncode == 1 else "UNUSABLE"
    print(f"== {os.path.basename(case_dir)} --only {mode}: {status}\n{result.stdout}{result.stderr}")
    return result.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--golden", default=GOLDEN_DIR, help="golden directory (default: tests/golden)")
    parser.add_argument("--case", action="append", help="case name (default: every case)")
    parser.add_argument("--mode", action="append", choices=MODES, help="forward, sampler or all (default: all three)")
    parser.add_argument("--perturb", metavar="TENSOR", help="add noise to one weight (shows a failing port)")
    args = parser.parse_args(argv)
    cases = args.case or sorted(d for d in os.listdir(args.golden)
                                if os.path.isfile(os.path.join(args.golden, d, "case.json")))
    worst = 0
    with tempfile.TemporaryDirectory() as workdir:
        for case in cases:
            for mode in args.mode or MODES:
                worst = max(worst, check(os.path.join(args.golden, case), mode, workdir, args.perturb))
    return worst


if __name__ == "__main__":
    sys.exit(main())
