"""SamplingParams: the one check of a request's decode settings (every field's bounds, each named in the error)."""

import math

import numpy as np
import pytest

from fire_jax.infer.sampling import INT32_MAX, MAX_STOP_IDS, SamplingParams


def test_defaults_are_greedy_and_the_engine_s_stop_ids():
    params = SamplingParams()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (128, 0.0, 1.0, 0, 0)
    assert params.greedy and params.stop_ids is None and params.stop == ()
    assert not params.replace(temperature=0.7).greedy


def test_sequences_become_tuples_so_the_settings_hash():
    params = SamplingParams(stop_ids=[3, 7], stop=["\n\n"], seed=np.uint32(5))
    assert params.stop_ids == (3, 7) and params.stop == ("\n\n",)
    assert hash(params) == hash(SamplingParams(stop_ids=(3, 7), stop=("\n\n",), seed=5))


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "max_tokens must be an integer in [1, 2147483647], got 0"),
    ("max_tokens", 2.0, "max_tokens must be an integer"),
    ("temperature", -0.1, "temperature must be in [0, 2], got -0.1"),
    ("temperature", 2.5, "temperature must be in [0, 2], got 2.5"),
    ("temperature", math.nan, "temperature must be in [0, 2], got nan"),
    ("temperature", True, "temperature must be in [0, 2], got True"),
    ("top_p", 1.5, "top_p must be in [0, 1], got 1.5"),
    ("top_p", math.nan, "top_p must be in [0, 1], got nan"),
    ("top_k", -1, "top_k must be an integer in [0, 2147483647] (0: off), got -1"),
    ("top_k", INT32_MAX + 1, "top_k must be an integer"),
    ("seed", -1, "seed must be an integer in [0, 2**32), got -1"),
    ("seed", 2 ** 32, "seed must be an integer in [0, 2**32)"),
    ("stop_ids", tuple(range(MAX_STOP_IDS + 1)), "stop_ids: at most 8 token ids"),
    ("stop_ids", (-1,), "stop_ids: at most 8 token ids, got [-1]"),
    ("stop", ("",), "stop: non-empty strings"),
])
def test_each_bad_field_is_named(field, value, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert str(error.value).startswith(message)


def test_every_problem_of_a_request_is_reported_at_once():
    with pytest.raises(ValueError, match=r"^temperature must .*; top_p must .*; seed must "):
        SamplingParams(temperature=3.0, top_p=-1.0, seed=-5)


def test_the_bounds_themselves_are_accepted():
    SamplingParams(max_tokens=INT32_MAX, temperature=2.0, top_p=0.0, top_k=INT32_MAX, seed=2 ** 32 - 1,
                   stop_ids=tuple(range(MAX_STOP_IDS)))
    SamplingParams(temperature=0, top_p=1)  # ints where floats are expected


def test_from_config_reads_the_sampling_fields_of_any_section():
    """A config section's ``max_new_tokens`` (the configs' and HF's name) becomes ``max_tokens``; temperature,
    top_k and top_p are read; the engine's fields and the caller's (``batch_size``) are not; None keeps the
    default; overrides come last and are checked like the rest."""
    import argparse

    import ml_collections

    section = ml_collections.ConfigDict(dict(max_new_tokens=16, temperature=0.5, top_k=3, top_p=0.9, batch_size=8,
                                             bucket_min=32, bucket_step=256, max_tiles=5))
    assert SamplingParams.from_config(section) == SamplingParams(max_tokens=16, temperature=0.5, top_k=3, top_p=0.9)
    assert SamplingParams.from_config(section, max_tokens=4, seed=9) == SamplingParams(
        max_tokens=4, temperature=0.5, top_k=3, top_p=0.9, seed=9)
    flags = argparse.Namespace(max_new_tokens=7, temperature=0.0, top_p=1.0, config="configs/tiny.py", seed=None)
    assert SamplingParams.from_config(flags) == SamplingParams(max_tokens=7)
    assert SamplingParams.from_config({"max_new_tokens": 9, "top_k": None}) == SamplingParams(max_tokens=9)
    with pytest.raises(ValueError, match="temperature must be in"):
        SamplingParams.from_config({"temperature": 2.5})
