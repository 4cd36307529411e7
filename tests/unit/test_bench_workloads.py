"""Throughput workloads: presets, what the command line overrides, and the random lengths."""

from __future__ import annotations

import pytest

from pagoda.bench.workloads import make_output_lens, make_prompts, resolve_workload
from pagoda.entrypoints.cli import build_parser


def _workload(*argv: str, model_given: bool = False):
    args = build_parser().parse_args(["bench", "throughput", *argv])
    return resolve_workload(args, model_given)


def test_a_preset_sets_model_counts_and_lengths() -> None:
    wl = _workload("--workload", "c")
    assert (wl.num_prompts, wl.input_len, wl.output_len) == (256, (128, 128), (1024, 1024))
    assert wl.random_weights is not None and wl.random_weights.name == "llama-3.1-8b"
    assert wl.engine["max_num_seqs"] == 256 and wl.roofline is None  # on, where there is a GPU


def test_options_override_the_preset_and_output_len_is_the_fixed_shorthand() -> None:
    wl = _workload("--workload", "a", "--num-prompts", "10", "--output-len", "64")
    assert wl.num_prompts == 10 and wl.output_len == (64, 64) and wl.input_len == (100, 1024)
    wl = _workload("--workload", "a", "--max-output-len", "200")
    assert wl.output_len == (100, 200)
    assert _workload("--workload", "a").roofline is False  # not a Llama-3.1-8B preset


def test_a_given_model_replaces_the_presets_random_weights() -> None:
    assert _workload("--workload", "b", model_given=True).random_weights is None


def test_without_a_preset_the_old_defaults_hold() -> None:
    wl = _workload()
    assert (wl.num_prompts, wl.input_len, wl.output_len) == (64, (32, 512), (128, 128))
    assert wl.random_weights is None


def test_bad_ranges_are_refused_with_the_lengths_named() -> None:
    with pytest.raises(ValueError, match=r"output lengths \[50, 10\]"):
        _workload("--min-output-len", "50", "--max-output-len", "10")


def test_lengths_are_uniform_in_the_range_and_the_prompts_avoid_special_ids() -> None:
    lens = make_output_lens(2000, 100, 1024, seed=0)
    assert min(lens) == 100 and max(lens) == 1024
    assert lens == make_output_lens(2000, 100, 1024, seed=0)
    prompts = make_prompts(50, 3, 9, vocab=20, seed=1, avoid={0, 2})
    assert all(3 <= len(p) <= 9 and not {0, 2} & set(p) for p in prompts)
    # The same seed gives the same prompts, whatever the output lengths.
    assert prompts == make_prompts(50, 3, 9, vocab=20, seed=1, avoid={0, 2})
