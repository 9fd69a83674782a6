"""transformers-style streamers on our generate: the adapter callback, and our streamer classes printing what
transformers' own TextStreamer / TextDiffusionStreamer print for the same run."""

from __future__ import annotations

import io
import os
from contextlib import redirect_stdout

import numpy as np
import pytest

from diffusiongemma.checkpoint import default_model_dir, load_text_side
from diffusiongemma.reference.support.errors import InputError
from diffusiongemma.reference.generate import GenerationConfig, generate
from diffusiongemma.reference.model import Model
from diffusiongemma.streamer import StreamerCallback, TextDiffusionStreamer, TextStreamer


@pytest.fixture(scope="module")
def shipped():
    path = default_model_dir()
    model = Model.from_pretrained(path)
    side = load_text_side(path)
    settings = GenerationConfig.from_pretrained(path).replace(max_new_tokens=3 * model.config.canvas_length,
                                                              max_denoising_steps=6, eos_token_id=())
    return path, model, side, settings


@pytest.fixture(scope="module")
def hf_tokenizer(shipped):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(shipped[0], "tokenizer.json"))


def run_printing(shipped, streamer, seed=5, prompt="And God said"):
    """stdout of one generate run driving ``streamer``, and the result."""
    _, model, side, settings = shipped
    out = io.StringIO()
    with redirect_stdout(out):
        result = generate(model, np.array([side.encode(prompt)]), generation_config=settings, random=seed,
                          callback=StreamerCallback(streamer))
    return out.getvalue(), result


class Recorder:
    """A streamer that records the calls it gets, as transformers' generate makes them."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(("put", np.asarray(value).copy()))

    def put_draft(self, value):
        self.calls.append(("put_draft", np.asarray(value).copy()))

    def end(self):
        self.calls.append(("end", None))


def test_adapter_makes_transformers_calls_in_order(shipped):
    recorder = Recorder()
    _, result = run_printing(shipped, recorder)
    kinds = [kind for kind, _ in recorder.calls]
    steps = result.steps_per_canvas
    expected = ["put"] + sum((["put_draft"] * s + ["put"] for s in steps), []) + ["end"]
    assert kinds == expected
    prompt_len = recorder.calls[0][1].shape[1]
    puts = [value for kind, value in recorder.calls if kind == "put"]
    assert np.array_equal(np.concatenate(puts, axis=1), result.sequences)  # prompt, then every canvas
    assert puts[0].shape[1] == prompt_len


def test_streamer_without_put_or_with_logits_is_refused():
    with pytest.raises(InputError, match="put\\(\\) and end\\(\\)"):
        StreamerCallback(object())
    wants_logits = TextDiffusionStreamer(tokenizer=None)
    wants_logits._takes_logits = True
    with pytest.raises(InputError, match="_takes_logits"):
        StreamerCallback(wants_logits)


@pytest.mark.slow
@pytest.mark.parametrize("skip_prompt", [False, True])
def test_text_diffusion_streamer_prints_what_transformers_prints(shipped, hf_tokenizer, skip_prompt):
    from transformers import TextDiffusionStreamer as HFTextDiffusionStreamer

    theirs, _ = run_printing(shipped, HFTextDiffusionStreamer(hf_tokenizer, skip_prompt=skip_prompt))
    ours_hf, _ = run_printing(shipped, TextDiffusionStreamer(hf_tokenizer, skip_prompt=skip_prompt))
    ours_tok, _ = run_printing(shipped, TextDiffusionStreamer(shipped[2].tokenizer, skip_prompt=skip_prompt))
    assert "\x1b7" in theirs and "\x1b[33m" in theirs  # drafts were drawn
    assert ours_hf == theirs
    assert ours_tok == theirs


def test_text_streamer_prints_what_transformers_prints(shipped, hf_tokenizer):
    from transformers import TextStreamer as HFTextStreamer

    theirs, result = run_printing(shipped, HFTextStreamer(hf_tokenizer, skip_special_tokens=True), seed=9)
    ours, _ = run_printing(shipped, TextStreamer(shipped[2], skip_special_tokens=True), seed=9)
    assert ours == theirs
    assert ours == shipped[2].decode(result.sequences[0]) + "\n"  # the whole text, in pieces


def test_text_streamer_pieces_follow_words():
    """Pieces end at spaces until a newline or letters-only text; the rest comes out at the end."""

    class Chars:
        def decode(self, ids, **kwargs):
            return "".join(chr(i) for i in ids)

    out = io.StringIO()
    streamer = TextStreamer(Chars(), stream=out)
    pieces = []
    streamer.on_finalized_text = lambda text, stream_end=False: pieces.append((text, stream_end))
    for chunk in ("ab", " c,d", "e f", "g\n", "h"):
        streamer.put(np.array([[ord(c) for c in chunk]]))
    streamer.end()
    assert pieces == [("ab", False), (" ", False), ("c,de ", False), ("fg\n", False), ("h", False), ("", True)]
    with pytest.raises(ValueError, match="batch size 1"):
        streamer.put(np.zeros((2, 3), dtype=np.int64))
