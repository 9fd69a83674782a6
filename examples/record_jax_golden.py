"""Record the JAX goldens of ``tests/golden/jax/`` from Google's own JAX DiffusionGemma.

    python examples/record_jax_golden.py draws          # jax.random values (needs jax only)
    python examples/record_jax_golden.py temperature    # the shaper's T for all 2016 (n, N), N < 64
    python examples/record_jax_golden.py window band    # sampler runs on tiny models
    python examples/record_jax_golden.py                # all of them

What runs here is the real thing: ``gemma/diffusion/`` of google-deepmind/gemma at main, commit
7691fd4e7f26c9ec5db38110dddb3addfab4d767 (2026-07-24). That package is not on the Python package index
(the newest ``gemma`` there, 4.0.1, has no ``gemma/diffusion``), so it is used from a snapshot of the
repository, installed editable without dependencies into a Python 3.12 virtual environment (the sampler
uses ``typing.override``) next to ``jax[cpu]``, ``flax``, ``kauldron`` and their dependencies, with
``sentencepiece`` held below 0.2.3 (kauldron installed without its dependencies, then the few modules it
imports). The goldens in the tree were recorded with Python 3.12.1, jax and jaxlib 0.12.0.1, flax 0.12.12
and kauldron 1.4.4 (each file's ``"versions"``) on a CPU; the four files take about 3 minutes.

The recording never goes through JAX's checkpoint loader: each sampler case takes one of the project's tiny
random transformers checkpoints (``tests/golden/tiny-a/model``), maps its tensors onto the JAX parameter
tree of ``DiffusionGemma_26B_A4B`` (``jax_params``; JAX's block has one ``skip_scale`` where the checkpoint
has an encoder and a decoder layer scalar, so the case's weights use the decoder's for both, and the replay
does the same), and drives ``gemma.diffusion.Sampler`` with a stand-in tokenizer that maps a prompt string
of ids to those ids. Recording subclasses of the sampler's stages (temperature shaper, sampling from
predictions, early stop) pass what each step computed to the host with ``jax.debug.callback``; they call
the upstream code and change nothing.

The sampler cases also scale the self-conditioning MLP's down projection by ``sc_down_scale`` (1/8), in
the recording and in the replay alike. JAX rounds the self-conditioning embedding to bfloat16; the
reference's float32 embedding differs from XLA's in the last bit, so now and then a component rounds to the
other bfloat16 neighbour, which at full scale moves the logits by ~1e-3, enough for the low temperatures that
make early stops happen on a random model to turn it into a different token a few steps later. At 1/8 the
same flips stay below 4e-4 and the replay is exact. ``JAX_GOLDEN_EVERY_LOGITS=1`` keeps every step's raw
logits in the .npz (for finding where a replay departs).

Files (``tests/golden/jax/``):

* ``draws.json``: threefry keys, splits, bits, ``randint``, ``uniform``, ``gumbel`` (as a digest of 65536
  values) and ``categorical`` of ``jax.random``, and one stream in the sampler's key tree; replayed by
  ``tests/test_jax_draws.py`` against ``reference/variants/jax_draws.py``.
* ``temperature.json``: the float32 bits of the temperature ``AnnealingTemperatureShaper`` divides by, for
  every step of every N < 64, recovered from its output inside a jitted loop.
* ``<case>.json`` (+ ``<case>.npz``: one step's logits): per canvas and step the input canvas, the argmax
  canvas, the accepted set, the sampled-and-renoised tokens and the stop flags, and the final tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "golden", "jax")
GEMMA_COMMIT = "7691fd4e7f26c9ec5db38110dddb3addfab4d767"

# the inputs of draws.json (the test regenerates the logits from the same NumPy seed)
KEY_SEEDS = (0, 1, 7, 42, 2**31 - 1, -1)
RANDINT = ((3, (5,), 0, 128), (3, (2, 6), 0, 96), (4, (3, 4), 0, 262144), (5, (7,), -10, 1000),
           (6, (4,), 5, 6), (6, (4,), 3, 3), (8, (2, 3), 0, 2**31 - 1))
UNIFORM = ((3, (6,), 0.0, 1.0), (9, (2, 5), -2.0, 3.0), (10, (8,), 1.1754944e-38, 1.0))
GUMBEL = (3, 65536)
CATEGORICAL = (5, (2, 8, 300))
STREAM = (11, 2, 6, 50, 2, 3)  # seed, B, C, V, canvases, steps per canvas


def categorical_logits(shape) -> np.ndarray:
    """The logits ``draws.json``'s categorical draws use: scaled normals with ties and -inf entries."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(shape) * 4).astype(np.float32)
    logits[..., 7] = -np.inf
    logits[0, 0, :] = np.float32(1.5)  # an all-equal row: the Gumbel noise alone decides
    logits[1, 2, 10:12] = logits[1, 2].max() + np.float32(3.0)  # a two-way tie at the top
    return logits


def stream_logits(step: int, B: int, C: int, V: int) -> np.ndarray:
    return (np.random.default_rng(100 + step).standard_normal((B, C, V)) * 2).astype(np.float32)


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for name in ("jax", "jaxlib", "flax", "kauldron", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    out["gemma"] = GEMMA_COMMIT
    return out


def _u32(a) -> list[int]:
    return np.asarray(a).view(np.uint32).ravel().tolist()


def record_draws() -> dict:
    import jax

    data: dict = {"versions": versions(), "keys": {}, "randint": [], "uniform": []}
    for seed in KEY_SEEDS:
        data["keys"][str(seed)] = _u32(jax.random.key_data(jax.random.key(seed)))
    key = jax.random.key(7)
    data["split"] = {"seed": 7, "num": 4, "keys": np.asarray(jax.random.key_data(jax.random.split(key, 4))).tolist()}
    data["bits"] = {"seed": 7, "shape": [2, 3], "values": _u32(jax.random.bits(key, (2, 3)))}
    for seed, shape, lo, hi in RANDINT:
        values = np.asarray(jax.random.randint(jax.random.key(seed), shape, lo, hi))
        data["randint"].append({"seed": seed, "shape": list(shape), "minval": lo, "maxval": hi,
                                "values": values.ravel().tolist()})
    for seed, shape, lo, hi in UNIFORM:
        values = jax.random.uniform(jax.random.key(seed), shape, minval=lo, maxval=hi)
        data["uniform"].append({"seed": seed, "shape": list(shape), "minval": lo, "maxval": hi, "bits": _u32(values)})
    seed, count = GUMBEL
    g = np.asarray(jax.random.gumbel(jax.random.key(seed), (count,)), dtype=np.float32)
    data["gumbel"] = {"seed": seed, "count": count, "first": _u32(g[:16]),
                      "sha256": hashlib.sha256(g.astype("<f4").tobytes()).hexdigest()}
    seed, shape = CATEGORICAL
    data["categorical"] = {"seed": seed, "shape": list(shape), "values": np.asarray(
        jax.random.categorical(jax.random.key(seed), categorical_logits(shape))).ravel().tolist()}
    data["stream"] = record_stream(*STREAM)
    return data


def record_stream(seed: int, B: int, C: int, V: int, canvases: int, steps: int) -> dict:
    """The draws of ``canvases`` canvases of ``steps`` steps in the key tree of ``DiffusionSampler``
    (``_sample_step`` -> ``sample_next_canvas`` -> ``body_fn`` -> ``SampleFromPredictions``)."""
    import jax

    root = jax.random.key(seed)
    out = []
    n = 0
    for _ in range(canvases):
        root, canvas_key = jax.random.split(root)
        initial, carried = jax.random.split(canvas_key)
        out.append({"kind": "canvas", "ids": np.asarray(jax.random.randint(initial, (B, C), 0, V)).tolist()})
        for _ in range(steps):
            carried, step_key = jax.random.split(carried)
            draw_key, noise_key = jax.random.split(step_key)
            ids = jax.random.categorical(draw_key, stream_logits(n, B, C, V))
            out.append({"kind": "categorical", "step": n, "ids": np.asarray(ids).tolist()})
            out.append({"kind": "renoise", "ids": np.asarray(jax.random.randint(noise_key, (B, C), 0, V)).tolist()})
            n += 1
    return {"seed": seed, "batch_size": B, "canvas_length": C, "vocab_size": V, "draws": out}


# ------------------------------------------------------------------------------------------ temperature
def record_temperature(t_min: float = 0.4, t_max: float = 0.8) -> dict:
    """The factor JAX's temperature shaper scales the logits by, at every step of every N in 1..63.

    Each N runs a jitted loop over its steps the sampler's way (noise proportions ``1 - arange(N + 1) / N``
    computed once and indexed by the step inside the loop, then the upstream ``AnnealingTemperatureShaper``)
    on a row of 64 logits. XLA's simplifier turns the division by the broadcast temperature into a
    multiplication by its float32 reciprocal, so the recorded value is that factor: the float32 ``r`` with
    ``z * r`` equal to the shaper's output bit for bit (searched within 8 units in the last place of
    ``1 / T`` of the closed form; exactly one must fit)."""
    import jax
    import jax.numpy as jnp
    from gemma.diffusion import _sampler

    shaper = _sampler.AnnealingTemperatureShaperConfig(min_temperature=t_min, max_temperature=t_max).make()
    logits = (np.random.default_rng(1).standard_normal((1, 1, 64)) * 5).astype(np.float32)
    table = {}
    for N in range(1, 64):
        @jax.jit
        def run(z, N=N):
            proportions = 1.0 - jnp.arange(N + 1) / N

            def body(i, acc):
                return acc.at[i].set(shaper(z, jnp.full((1,), proportions[i]))[0, 0])

            return jax.lax.fori_loop(0, N, body, jnp.zeros((N, z.shape[-1]), z.dtype))

        shaped = np.asarray(run(logits))
        bits = []
        for i in range(N):
            p = np.float32(1.0) - np.float32(i) / np.float32(N)
            guess = (np.float32(1.0) - (np.float32(1.0) - p)) * np.float32(t_max - t_min) + np.float32(t_min)
            centre = int((np.float32(1.0) / guess).view(np.uint32))
            matches = [c for c in range(centre - 8, centre + 9)
                       if np.array_equal((logits[0, 0] * np.uint32(c).view(np.float32)).view(np.uint32),
                                         shaped[i].view(np.uint32))]
            if len(matches) != 1:
                raise SystemExit(f"N={N} step {i}: {len(matches)} factors reproduce the shaper's output")
            bits.append(matches[0])
        table[str(N)] = bits
    return {"versions": versions(), "t_min": t_min, "t_max": t_max,
            "note": "bits[N][i]: float32 bits of the factor the logits are multiplied by at step index i "
                    "(0 = the first step) of N; the reference's step n is N - i",
            "bits": table}


# ------------------------------------------------------------------------------------------ sampler cases
# Each case: a project checkpoint (tests/golden/<model>/model), an optional sliding-window override, the
# prompt rows, the JAX seed and the sampler settings. The replay (tests/test_jax_golden.py) maps them onto
# GenerationConfig: eos_token_id = end_tokens, confidence_threshold = entropy_threshold, same N, bound, T.
CASES = {
    "window": {"model": "tiny-a", "sliding_window": 16, "sc_down_scale": 0.125, "seed": 3,
               "prompts": [[2, 17, 99, 45, 3, 88, 12, 61, 7, 30, 5]],
               "max_new_tokens": 48, "max_denoising_steps": 16, "entropy_bound": 1.0,
               "entropy_threshold": 0.5, "t_min": 0.02, "t_max": 0.05, "end_tokens": [61]},
    "band": {"model": "tiny-a", "sliding_window": None, "sc_down_scale": 0.125, "seed": 5,
             "prompts": [[2, 40, 8, 77, 19, 100, 6, 51, 23, 64, 9, 33, 90], [2, 5, 61, 14, 120, 37, 82, 11, 3, 70, 46, 25, 58]],
             "max_new_tokens": 48, "max_denoising_steps": 16, "entropy_bound": 1.0,
             "entropy_threshold": 0.5, "t_min": 0.02, "t_max": 0.05, "end_tokens": [48]},
}
LOGITS_STEP = (0, 1)  # (canvas, step index) whose raw logits the case's .npz keeps


def load_case_model(case: dict) -> tuple[dict, int, dict]:
    """(text config with the case's window, canvas length, tensors by transformers name) of a case."""
    from safetensors.numpy import load_file

    directory = os.path.join(ROOT, "tests", "golden", case["model"], "model")
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    text = dict(config["text_config"])
    if case.get("sliding_window"):
        text["sliding_window"] = case["sliding_window"]
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    scale = case.get("sc_down_scale", 1.0)
    if scale != 1.0:
        name = "model.decoder.self_conditioning.down_proj.weight"
        tensors[name] = (tensors[name] * np.float32(scale)).astype(np.float32)
    return text, int(config["canvas_length"]), tensors


def jax_config(text: dict):
    """The ``gemma4`` TransformerConfig of a project text config (26B-A4B layout: MoE + dense MLP)."""
    from gemma.gm.nn.gemma4 import _config, _modules

    kinds = {"sliding_attention": _modules.AttentionType.LOCAL_SLIDING, "full_attention": _modules.AttentionType.GLOBAL}
    full = [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"]
    per_layer = text.get("per_layer_config", {})
    g = per_layer.get(str(full[0]), {}) if full else {}
    rope = text["rope_parameters"]
    return _config.TransformerConfig(
        num_embed=text["vocab_size"], embed_dim=text["hidden_size"], hidden_dim=text["intermediate_size"],
        num_heads=text["num_attention_heads"], head_dim=text["head_dim"], num_kv_heads=text["num_key_value_heads"],
        final_logit_softcap=text["final_logit_softcapping"], use_post_attn_norm=True, use_post_ffw_norm=True,
        attention_types=tuple(kinds[t] for t in text["layer_types"]), sliding_window_size=text["sliding_window"],
        num_global_kv_heads=g.get("num_key_value_heads", text["num_key_value_heads"]),
        global_key_size=g.get("head_dim", text["head_dim"]), k_eq_v_global=True,
        global_rope_proportion=rope["full_attention"].get("partial_rotary_factor", 1.0), local_rope_proportion=1.0,
        local_base_frequency=int(rope["sliding_attention"]["rope_theta"]),
        global_base_frequency=int(rope["full_attention"]["rope_theta"]),
        enable_moe=True, num_experts=text["num_experts"], expert_dim=text["moe_intermediate_size"],
        top_k_experts=text["top_k_experts"], moe_dense_hidden_dim=text["intermediate_size"],
        use_bidirectional_attention=None)


def jax_params(text: dict, tensors: dict) -> dict:
    """The transformers tensors of a checkpoint as the JAX parameter tree (float32). The layer's single
    ``skip_scale`` takes the decoder's layer scalar (the encoder's is not representable)."""
    t = {k[len("model."):]: np.asarray(v, np.float32) for k, v in tensors.items() if k.startswith("model.decoder.")}
    H, n_h = text["hidden_size"], text["num_attention_heads"]

    def heads(w, n):  # (n*d, H) -> (n, H, d)
        return w.reshape(n, -1, H).transpose(0, 2, 1)

    params = {"embedder": {"input_embedding": t["decoder.embed_tokens.weight"]},
              "final_norm": {"scale": t["decoder.norm.weight"]},
              "self_conditioner": {
                  "pre_norm": {"scale": t["decoder.self_conditioning.pre_norm.weight"]},
                  "ffw": {"gating_einsum": np.stack([t["decoder.self_conditioning.gate_proj.weight"],
                                                     t["decoder.self_conditioning.up_proj.weight"]]),
                          "linear": t["decoder.self_conditioning.down_proj.weight"].T}}}
    for l, kind in enumerate(text["layer_types"]):
        w = lambda name: t[f"decoder.layers.{l}.{name}"]  # noqa: E731
        g = w("self_attn.k_proj.weight").shape[0] // w("self_attn.k_norm.weight").shape[0]
        attn = {"q_einsum": {"w": heads(w("self_attn.q_proj.weight"), n_h)},
                "query_norm": {"scale": w("self_attn.q_norm.weight")},
                "key_norm": {"scale": w("self_attn.k_norm.weight")},
                "attn_vec_einsum": {"w": w("self_attn.o_proj.weight").T.reshape(n_h, -1, H)}}
        if kind == "full_attention":
            attn["k_einsum"] = {"w": heads(w("self_attn.k_proj.weight"), g)}
        else:
            attn["kv_einsum"] = {"w": np.stack([heads(w("self_attn.k_proj.weight"), g),
                                                heads(w("self_attn.v_proj.weight"), g)])}
        gate_up = w("experts.gate_up_proj")  # (E, 2I, H): gate rows, then up rows
        E = gate_up.shape[0]
        params[f"layer_{l}"] = {
            "pre_attention_norm": {"scale": w("input_layernorm.weight")},
            "post_attention_norm": {"scale": w("post_attention_layernorm.weight")},
            "attn": attn,
            "pre_ffw2_norm": {"scale": w("pre_feedforward_layernorm.weight")},
            "mlp2": {"gating_einsum": np.stack([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]),
                     "linear": w("mlp.down_proj.weight").T},
            "post_ffw2_norm": {"scale": w("post_feedforward_layernorm_1.weight")},
            "pre_ffw_norm": {"scale": w("pre_feedforward_layernorm_2.weight")},
            "mlp": {"router_logits": {"w": w("router.proj.weight").T}, "router_scale": w("router.scale"),
                    "per_expert_scale": w("router.per_expert_scale"),
                    "gating_einsum": {"w": gate_up.reshape(E, 2, -1, H)},
                    "linear": {"w": w("experts.down_proj").transpose(0, 2, 1)}},
            "post_ffw1_norm": {"scale": w("post_feedforward_layernorm_2.weight")},
            "post_ffw_norm": {"scale": w("post_feedforward_layernorm.weight")},
            "skip_scale": w("layer_scalar"),
        }
    return params


class _Sink:
    """What the recording stages report, in the order the jitted loop runs them."""

    def __init__(self):
        self.events: list[tuple] = []

    def shaper(self, raw, shaped, proportion):
        self.events.append(("shaper", np.array(raw), np.array(shaped), np.array(proportion)))

    def sample(self, canvas, proposed, noise, accepted, out):
        self.events.append(("sample", np.array(canvas), np.array(proposed), np.array(noise), np.array(accepted),
                            np.array(out)))

    def stop(self, step, argmax, stop):
        self.events.append(("stop", int(step), np.array(argmax), np.array(stop)))


def _recording_stages(sink: _Sink):
    """Subclasses of the sampler's stages that report to ``sink`` and otherwise run upstream's code."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from gemma.diffusion import _early_stopping, _sampler

    @dataclasses.dataclass(frozen=True)
    class Shaper(_sampler.AnnealingTemperatureShaper):
        def __call__(self, logits, noise_proportion):
            out = super().__call__(logits, noise_proportion)
            jax.debug.callback(sink.shaper, logits, out, noise_proportion, ordered=True)
            return out

    @dataclasses.dataclass(frozen=True)
    class Sample(_sampler.SampleFromPredictions):
        def __call__(self, *, rng, denoiser_logits, canvas, current_noise_proportion, target_noise_proportion):
            out = super().__call__(rng=rng, denoiser_logits=denoiser_logits, canvas=canvas,
                                   current_noise_proportion=current_noise_proportion,
                                   target_noise_proportion=target_noise_proportion)
            draw_key, noise_key = jax.random.split(rng)  # the same keys upstream splits
            z = denoiser_logits.astype(jnp.float32)
            proposed = jax.random.categorical(draw_key, z)
            noise = jax.random.randint(noise_key, canvas.shape, 0, self.text_vocab_size)
            # the entropy-bound selection of this step (ascending entropies, the prefix whose sum before
            # each position stays within the bound), to name the accepted set where proposal = noise
            logp = jax.nn.log_softmax(z)
            p = jnp.exp(logp)
            entropy = -jnp.sum(jnp.where(p == 0, 0.0, logp) * p, axis=-1)
            order = jnp.argsort(entropy, axis=-1)
            ranked = jnp.take_along_axis(entropy, order, axis=-1)
            keep = (jnp.cumsum(ranked, axis=-1) - ranked) <= self.entropy_bound
            accepted = jnp.zeros_like(keep).at[jnp.arange(canvas.shape[0])[:, None], order].set(keep)
            jax.debug.callback(sink.sample, canvas, proposed, noise, accepted, out, ordered=True)
            return out

    @dataclasses.dataclass(frozen=True)
    class Stop(_early_stopping.ChainedEarlyStop):
        def should_stop(self, *, step, canvas, previous_canvas, logits):
            out = super().should_stop(step=step, canvas=canvas, previous_canvas=previous_canvas, logits=logits)
            jax.debug.callback(sink.stop, step, jnp.argmax(logits, axis=-1), out, ordered=True)
            return out

    return Shaper, Sample, Stop


class IdTokenizer:
    """A stand-in tokenizer: a prompt is its ids written as decimal numbers; no BOS is added."""

    VERSION = None
    FORBIDDEN_TOKENS = ()

    def __init__(self, vocab_size: int, end_token: int):
        import dialog
        from gemma.gm.text import _tokenizer

        class Special(_tokenizer.SpecialTokens):
            PAD = 0
            EOS = end_token
            BOS = 2
            UNK = 3
            MASK = 4
            CUSTOM = 5
            START_OF_TURN = 6
            END_OF_TURN = end_token
            START_OF_IMAGE = 8
            END_OF_IMAGE = 9
            BEGIN_OF_TOOL_RESPONSE = end_token
            END_OF_TOOL_RESPONSE = 11

        self.vocab_size = vocab_size
        self.special_tokens = Special
        self.FORMAT = dialog.Format.GEMMA3

    def encode(self, text, *, add_bos=False, add_eos=False):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(str(int(i)) for i in np.asarray(ids).ravel())


def record_case(name: str, case: dict | None = None) -> tuple[dict, dict]:
    """Run the JAX sampler on one case (``CASES[name]`` unless given); returns (the case's JSON data, the
    arrays of its .npz)."""
    import jax
    import jax.numpy as jnp
    from gemma.diffusion import _chat_sampler, _early_stopping, _models, _sampler

    case = CASES[name] if case is None else case
    text, C, tensors = load_case_model(case)
    if len(set(case["end_tokens"])) != 1:
        raise SystemExit("the stand-in tokenizer has one end token")
    sink = _Sink()
    Shaper, Sample, Stop = _recording_stages(sink)
    model = _models.DiffusionGemma_26B_A4B(config=jax_config(text), dtype=jnp.float32)
    params = jax.tree_util.tree_map(jnp.asarray, jax_params(text, tensors))
    prompts = case["prompts"]
    P = max(len(p) for p in prompts)
    if any(len(p) != P for p in prompts) or any(0 in p for p in prompts):
        raise SystemExit("prompts must have equal lengths and no id 0 (JAX pads on the right with id 0)")
    sampler = _chat_sampler.Sampler(
        model=model, params=params, tokenizer=IdTokenizer(text["vocab_size"], case["end_tokens"][0]),
        cache_length=P + case["max_new_tokens"] + 2 * C, max_out_length=case["max_new_tokens"], pad_length=None,
        canvas_length=C, max_denoising_steps=case["max_denoising_steps"],
        logit_shaper=Shaper(config=_sampler.AnnealingTemperatureShaperConfig(
            min_temperature=case["t_min"], max_temperature=case["t_max"])),
        sample_from_predictions=Sample(entropy_bound=case["entropy_bound"]),
        early_stop_fn=Stop(early_stop_fns=(_early_stopping.TokenStabilityEarlyStop(),
                                           _early_stopping.EntropyEarlyStop(
                                               entropy_threshold=case["entropy_threshold"]))))
    out = sampler.sample([" ".join(map(str, p)) for p in prompts], max_new_tokens=case["max_new_tokens"],
                         rng=case["seed"], return_state=True)
    tokens = np.asarray(out.state.predicted_tokens)
    jax.effects_barrier()
    return assemble(name, case, C, text, tokens, sink.events)


def assemble(name, case, C, text, tokens, events) -> tuple[dict, dict]:
    """Group the reported events into canvases and steps, checking the stream is what the loop runs."""
    canvases, arrays = [], {}
    i = 0
    while i < len(events):
        (k1, raw, shaped, proportion), (k2, canvas, proposed, noise, accepted, out), (k3, step, argmax, stop) = \
            events[i:i + 3]
        if (k1, k2, k3) != ("shaper", "sample", "stop"):
            raise SystemExit(f"unexpected event order at {i}: {(k1, k2, k3)}")
        if step == 0:
            canvases.append([])
        # the reported selection must explain the sampled tokens wherever proposal and noise differ
        clear = proposed != noise
        if not np.array_equal(np.where(accepted, proposed, noise), out) or not (
                (out[clear] == proposed[clear]) == accepted[clear]).all():
            raise SystemExit(f"canvas {len(canvases) - 1} step {step}: the accepted set does not explain the tokens")
        if (len(canvases) - 1, step) == LOGITS_STEP:
            arrays["raw_logits"], arrays["shaped_logits"] = raw.astype(np.float32), shaped.astype(np.float32)
        if os.environ.get("JAX_GOLDEN_EVERY_LOGITS"):  # for debugging a replay: every step's raw logits
            arrays[f"raw_{len(canvases) - 1}_{step}"] = raw.astype(np.float32)
        canvases[-1].append({"step": step, "noise_proportion_bits": _u32(proportion.astype(np.float32))[:1],
                             "input_canvas": canvas.tolist(), "argmax": argmax.tolist(),
                             "proposed": proposed.tolist(), "accepted": accepted.astype(int).tolist(),
                             "sampled": out.tolist(), "stop": stop.astype(bool).tolist()})
        i += 3
    with open(os.path.join(ROOT, "tests", "golden", case["model"], "model", "model.safetensors"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    data = dict(case, case=name, canvas_length=C, vocab_size=text["vocab_size"], weights_sha256=digest,
                sliding_window=text["sliding_window"], versions=versions(),
                weights_rule=("tests/golden/<model>/model with every encoder layer scalar replaced by the decoder's and "
                              "self_conditioning.down_proj multiplied by sc_down_scale"),
                logits_step=list(LOGITS_STEP), canvases=canvases, tokens=tokens.tolist(),
                steps_per_canvas=[len(c) for c in canvases])
    return data, arrays


def write_json(name: str, data: dict) -> str:
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=None, separators=(",", ":"))
        f.write("\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="*", choices=["draws", "temperature", *CASES])
    args = parser.parse_args(argv)
    for what in args.what or ["draws", "temperature", *CASES]:
        if what == "draws":
            print("wrote", write_json("draws.json", record_draws()))
        elif what == "temperature":
            print("wrote", write_json("temperature.json", record_temperature()))
        else:
            data, arrays = record_case(what)
            print("wrote", write_json(f"{what}.json", data), "steps per canvas", data["steps_per_canvas"])
            np.savez_compressed(os.path.join(OUT, f"{what}.npz"), **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
