"""Peak memory of ``diffusiongemma-convert`` against checkpoint size and largest tensor.

Builds a synthetic sharded bfloat16 transformers checkpoint (safetensors shards written
directly under the upstream tensor names, for a 6-layer config with V=32768, H=1024 and 32
experts; about 435 MiB) in a temporary directory, converts it in a fresh subprocess per setting,
and prints that subprocess's peak resident set size (``resource.getrusage(...).ru_maxrss``) next
to the checkpoint size, the largest tensor and the output shard size. "baseline" is the peak of a
subprocess that only imports the converter; "peak - baseline" is what the conversion added.

What the streaming design predicts for peak - baseline: the largest tensor twice while it is
read (safetensors' mapped file pages plus the copy it returns), or the source tensor plus its
float32 widening, plus at most one pending output shard (``--shard-size``); never the checkpoint.

Run:  OMP_NUM_THREADS=1 python benchmarks/converter_memory.py

Measured (2 shared CPU cores, Linux, Python 3.11.7, safetensors 0.8.0, numpy 2.4):

    checkpoint: 434.7 MiB bf16 in 5 shards, 227,004,364 parameters, 144 tensors
    largest tensor: 64.0 MiB as bf16 (128.0 MiB as float32)
    baseline (imports only): 40.5 MiB
    dtype     shard size     output   peak RSS  peak-baseline    time
    float32    256.0 MiB  866.0 MiB  336.6 MiB      296.1 MiB   3.6 s
    float32     64.0 MiB  866.0 MiB  236.5 MiB      196.0 MiB   4.0 s
    bfloat16    64.0 MiB  433.0 MiB  168.4 MiB      127.9 MiB   3.3 s

So bf16 -> bf16 adds 2 x the largest tensor (128 MiB) for a 435 MiB checkpoint; bf16 -> float32
adds the 64 MiB source tensor, its 128 MiB widening and what the pending shard holds, and the
256 MiB shard size costs about 100 MiB more than the 64 MiB one. The checkpoint size does not
enter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.weights import expected_shapes
from diffusiongemma.weights_converter.names import hf_name

MiB = 2 ** 20
SLIDING, FULL = "sliding_attention", "full_attention"

# A scaled-down DiffusionGemma text config (transformers field names), big enough that the
# tensors dwarf the interpreter: the embedding is 32 Mi parameters, each expert bank 16 Mi.
TEXT_CONFIG = dict(
    model_type="diffusion_gemma_text", vocab_size=32768, hidden_size=1024, intermediate_size=1024,
    moe_intermediate_size=256, num_hidden_layers=6, layer_types=[SLIDING] * 5 + [FULL],
    num_attention_heads=8, num_key_value_heads=4, head_dim=128,
    per_layer_config={"5": {"head_dim": 256, "num_key_value_heads": 1}},
    num_experts=32, top_k_experts=4, sliding_window=1024, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0, use_bidirectional_attention="vision",
    rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 1e4},
                     FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}},
    pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
)
CONFIG = dict(model_type="diffusion_gemma", architectures=["DiffusionGemmaForBlockDiffusion"], canvas_length=256,
              tie_word_embeddings=True, text_config=TEXT_CONFIG, transformers_version="5.24.0")


def build_checkpoint(path: str, shard_bytes: int = 100 * MiB, seed: int = 0) -> dict:
    """Write a sharded bf16 checkpoint into ``path``; returns sizes (holds one shard in memory)."""
    rng = np.random.default_rng(seed)
    shapes = expected_shapes(ModelConfig.from_transformers(CONFIG))
    tensors = {hf_name(name): shape for name, shape in shapes.items()}
    tensors["model.encoder.vision_tower.patch_embedder.input_proj.weight"] = (1152, 768)  # skipped on purpose
    weight_map, shard, shard_size, files = {}, {}, 0, []

    def flush():
        filename = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, os.path.join(path, filename), metadata={"format": "pt"})
        files.append(filename)
        weight_map.update({key: filename for key in shard})

    for key, shape in tensors.items():
        values = (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(ml_dtypes.bfloat16)
        if shard and shard_size + values.nbytes > shard_bytes:
            flush()
            shard, shard_size = {}, 0
        shard[key] = values
        shard_size += values.nbytes
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    largest = max(math.prod(s) for s in tensors.values())
    return {"bytes": 2 * sum(math.prod(s) for s in tensors.values()), "files": len(files),
            "tensors": len(tensors), "parameters": sum(math.prod(s) for s in shapes.values()),
            "largest_elements": largest}


_CHILD = """
import resource, sys
from diffusiongemma.weights_converter import convert
if sys.argv[1] != "--baseline":
    convert(sys.argv[1], sys.argv[2], dtype=sys.argv[3], shard_size=int(sys.argv[4]), progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def peak_rss(*args: str) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of one conversion in a fresh interpreter.

    Linux carries ``ru_maxrss`` across ``exec`` from the forking process, so the parent that
    starts these children must itself stay small: the checkpoint is built in a separate child.
    """
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, *args], check=True, capture_output=True, text=True)
    return int(out.stdout.split()[-1]) / 1024, time.perf_counter() - start  # ru_maxrss is KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed at the end)")
    parser.add_argument("--build-only", metavar="SRC", help=argparse.SUPPRESS)  # internal: build, print sizes
    args = parser.parse_args()
    if args.build_only:
        print(json.dumps(build_checkpoint(args.build_only)))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        src = os.path.join(tmp, "hf")
        os.mkdir(src)
        built = subprocess.run([sys.executable, __file__, "--build-only", src], check=True,
                               capture_output=True, text=True)
        info = json.loads(built.stdout)
        print(f"checkpoint: {info['bytes'] / MiB:.1f} MiB bf16 in {info['files']} shards, "
              f"{info['parameters']:,} parameters, {info['tensors']} tensors")
        print(f"largest tensor: {2 * info['largest_elements'] / MiB:.1f} MiB as bf16 "
              f"({4 * info['largest_elements'] / MiB:.1f} MiB as float32)")
        baseline, _ = peak_rss("--baseline")
        print(f"baseline (imports only): {baseline:.1f} MiB")
        print(f"{'dtype':<9} {'shard size':>10}  {'output':>9}  {'peak RSS':>9}  {'peak-baseline':>13}  {'time':>6}")
        for i, (dtype, shard) in enumerate([("float32", 256 * MiB), ("float32", 64 * MiB), ("bfloat16", 64 * MiB)]):
            dst = os.path.join(tmp, f"out{i}")
            peak, seconds = peak_rss(src, dst, dtype, str(shard))
            output = sum(os.path.getsize(os.path.join(dst, n)) for n in os.listdir(dst) if n.endswith(".safetensors"))
            print(f"{dtype:<9} {shard / MiB:>6.1f} MiB  {output / MiB:>5.1f} MiB  {peak:>5.1f} MiB  "
                  f"{peak - baseline:>9.1f} MiB  {seconds:>4.1f} s")


if __name__ == "__main__":
    main()
