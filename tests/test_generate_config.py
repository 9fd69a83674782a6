"""GenerationConfig: transformers' names and defaults, validation, generation_config.json reading."""

from __future__ import annotations

import json

import pytest

from diffusiongemma.reference.support.errors import ConfigError
from diffusiongemma.reference.generate import GenerationConfig

import transformers.models.diffusion_gemma.generation_diffusion_gemma as hf_generation  # the test extra (README) installs it

# SPEC §2.2: what the converter writes for the released checkpoint
RELEASED = {
    "max_new_tokens": 256, "max_denoising_steps": 48,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1, "confidence_threshold": 0.005,
    "eos_token_id": [1, 106, 50], "pad_token_id": 0, "transformers_version": "5.24.0",
    "return_dict_in_generate": True,
}


def test_defaults_are_transformers_global_defaults():
    config = GenerationConfig()
    defaults = hf_generation.DiffusionGemmaGenerationConfig._get_default_generation_params()
    for name in ("max_new_tokens", "max_denoising_steps", "t_min", "t_max", "stability_threshold",
                 "confidence_threshold"):
        assert getattr(config, name) == defaults[name], name
    assert config.entropy_bound == defaults["sampler_config"].entropy_bound
    assert config.max_length is None and config.eos_token_id == () and config.pad_token_id is None  # since 5.12
    assert config.uses_temperature and config.uses_adaptive_stopping


BAD = [
    ("max_new_tokens", 0), ("max_new_tokens", -3), ("max_new_tokens", 2.5), ("max_new_tokens", None),
    ("max_length", 0), ("max_length", -1),
    ("max_denoising_steps", 0), ("max_denoising_steps", 1.0), ("max_denoising_steps", True),
    ("entropy_bound", 0.0), ("entropy_bound", -0.1), ("entropy_bound", float("nan")), ("entropy_bound", None),
    ("t_min", -0.1), ("t_max", -0.5), ("t_min", float("inf")),
    ("stability_threshold", -1), ("stability_threshold", 1.5),
    ("confidence_threshold", 0.0), ("confidence_threshold", -1.0), ("confidence_threshold", "0.1"),
    ("eos_token_id", -1), ("eos_token_id", [1, -2]), ("eos_token_id", "1"), ("eos_token_id", [1.5]),
    ("pad_token_id", -1),
]


@pytest.mark.parametrize("field, value", BAD)
def test_bad_settings_raise_config_error_naming_field_and_value(field, value):
    with pytest.raises(ConfigError) as error:
        GenerationConfig(**{field: value})
    assert field in str(error.value)
    shown = "-2" if value == [1, -2] else "1.5" if value == [1.5] else repr(value) if value is not None else "None"
    assert shown in str(error.value)


@pytest.mark.parametrize("t_min, t_max", [(0.5, 0.5), (0.8, 0.4)])
def test_t_max_must_exceed_t_min(t_min, t_max):
    with pytest.raises(ConfigError, match=r"t_max \(.*\) must be greater than t_min"):
        GenerationConfig(t_min=t_min, t_max=t_max)


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", 0), ("max_length", 0), ("max_denoising_steps", 0), ("t_min", -0.1), ("t_max", -0.5),
    ("stability_threshold", -1), ("confidence_threshold", -1.0), ("confidence_threshold", 0.0)])
def test_what_we_reject_transformers_rejects_too(field, value):
    """(transformers raises AttributeError instead of ValueError for bad thresholds: its message reads a
    missing ``entropy_bound`` attribute.)"""
    with pytest.raises((ValueError, AttributeError)):
        hf_generation.DiffusionGemmaGenerationConfig(**{field: value})


def test_none_switches_off_the_schedule_and_the_adaptive_stop_like_transformers():
    assert not GenerationConfig(t_min=None).uses_temperature
    assert not GenerationConfig(t_max=None).uses_temperature
    assert not GenerationConfig(confidence_threshold=None).uses_adaptive_stopping
    assert not GenerationConfig(stability_threshold=None).uses_adaptive_stopping


def test_eos_ids_are_normalised_to_a_tuple():
    assert GenerationConfig(eos_token_id=1).eos_token_id == (1,)
    assert GenerationConfig(eos_token_id=[1, 106, 50]).eos_token_id == (1, 106, 50)
    assert GenerationConfig(eos_token_id=None).eos_token_id == ()
    assert GenerationConfig(confidence_threshold=10).confidence_threshold == 10.0  # transformers refuses ints


def test_replace_validates_and_refuses_unknown_fields():
    config = GenerationConfig().replace(max_new_tokens=64, eos_token_id=2)
    assert config.max_new_tokens == 64 and config.eos_token_id == (2,)
    with pytest.raises(ConfigError, match="top_k"):
        GenerationConfig().replace(top_k=5)
    with pytest.raises(ConfigError, match="max_denoising_steps"):
        GenerationConfig().replace(max_denoising_steps=0)


def test_from_dict_reads_the_released_generation_config():
    config = GenerationConfig.from_dict(RELEASED)
    assert config == GenerationConfig(eos_token_id=[1, 106, 50], pad_token_id=0)
    assert GenerationConfig.from_dict(config.to_dict()) == config


def test_null_fields_mean_default():
    data = dict(RELEASED, t_min=None, confidence_threshold=None, max_denoising_steps=None,
                sampler_config={"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": None})
    config = GenerationConfig.from_dict(data)
    assert (config.t_min, config.confidence_threshold, config.max_denoising_steps, config.entropy_bound) == \
        (0.4, 0.005, 48, 0.1)
    assert GenerationConfig.from_dict(dict(RELEASED, sampler_config=None)).entropy_bound == 0.1


@pytest.mark.parametrize("change, match", [
    ({"top_p": 0.9}, "unknown generation_config key 'top_p'"),
    ({"sampler_config": {"_cls_name": "OtherSampler", "entropy_bound": 0.1}}, "OtherSampler"),
    ({"sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "bound": 0.1}}, "bound"),
    ({"sampler_config": 0.1}, "sampler_config must be an object"),
    ({"cache_implementation": "static"}, "static"),
    ({"stability_threshold": -2}, "stability_threshold"),
])
def test_from_dict_refuses_what_the_reference_cannot_honour(change, match):
    with pytest.raises(ConfigError, match=match):
        GenerationConfig.from_dict(dict(RELEASED, **change))


def test_from_pretrained_reads_what_transformers_saves(tmp_path):
    hf = hf_generation.DiffusionGemmaGenerationConfig(
        max_new_tokens=100, max_denoising_steps=20, t_min=0.3, t_max=0.9, stability_threshold=2,
        confidence_threshold=0.01, sampler_config=hf_generation.EntropyBoundSamplerConfig(entropy_bound=0.25),
        eos_token_id=[1, 106], pad_token_id=0, cache_implementation="dynamic")
    hf.save_pretrained(tmp_path)
    config = GenerationConfig.from_pretrained(tmp_path)
    assert config == GenerationConfig(max_new_tokens=100, max_denoising_steps=20, t_min=0.3, t_max=0.9,
                                      stability_threshold=2, confidence_threshold=0.01, entropy_bound=0.25,
                                      eos_token_id=(1, 106), pad_token_id=0)
    assert GenerationConfig.from_pretrained(tmp_path / "generation_config.json") == config


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no generation config"):
        GenerationConfig.from_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        GenerationConfig.from_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="JSON object"):
        GenerationConfig.from_pretrained(tmp_path)
