"""The throughput benchmark's workloads: named presets, and the random prompts of a workload.

A preset fixes the model (a config.json under ``benchmarks/configs``, run on random weights), the
request count, the input and output length ranges, and the engine settings that size the run;
any option given on the command line wins over the preset.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

CONFIGS_DIR = Path("benchmarks/configs")


@dataclass(frozen=True)
class Preset:
    config: str  # folder name under benchmarks/configs
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    engine: dict[str, Any]  # engine settings, applied where the user left the default
    static_batch_size: int
    peer_num_prompts: int | None = None  # None: peers run the whole workload
    roofline: bool = False  # on by default (on a GPU)
    roofline_batches: tuple[int, ...] = (1, 64, 256)
    roofline_input_len: int = 512
    roofline_steps: int = 32
    temperature: float = 0.0  # 0: greedy
    draws: str = "numpy"  # "nano": nano-vllm's bench.py draws (Python's random, seed 0)
    peers: str = "all"  # transformers engines run beside Pagoda unless --peers says otherwise


def _llama8b(n: int, inp: int, out: int, static: int, peer_n: int) -> Preset:
    engine = {"max_num_seqs": 256, "max_model_len": inp + out, "max_num_batched_tokens": 8192}
    return Preset("llama-3.1-8b", n, (inp, inp), (out, out), engine, static, peer_n, True)


PRESETS: dict[str, Preset] = {
    # Qwen3-0.6B, lengths uniform in [100, 1024]: the acceptance workload against transformers.
    "a": Preset(
        "qwen3-0.6b",
        256,
        (100, 1024),
        (100, 1024),
        {"max_num_seqs": 256, "max_model_len": 2048, "max_num_batched_tokens": 8192},
        static_batch_size=128,
    ),
    "b": _llama8b(1000, 1024, 128, static=64, peer_n=256),  # prefill-heavy
    "c": _llama8b(256, 128, 1024, static=256, peer_n=128),  # decode-heavy
    # nano-vllm's own benchmark, drawn exactly as its bench.py draws it (133,966 output tokens):
    # figures compare with that project's published ones. Sampled at temperature 0.6.
    "nano": Preset(
        "qwen3-0.6b",
        256,
        (100, 1024),
        (100, 1024),
        {"max_num_seqs": 256, "max_model_len": 2048, "max_num_batched_tokens": 16384},
        static_batch_size=128,
        temperature=0.6,
        draws="nano",
        peers="none",  # nano-vllm itself is the peer here, run by its own script
    ),
    # A tiny random model: every code path on a CPU in seconds.
    "smoke": Preset(
        "tiny-llama",
        8,
        (8, 48),
        (4, 24),
        {"max_num_seqs": 8, "max_model_len": 128},
        static_batch_size=4,
        roofline_batches=(1, 4, 8),
        roofline_input_len=16,
        roofline_steps=8,
    ),
}


@dataclass
class Workload:
    name: str
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    dataset_seed: int
    random_weights: Path | None  # a folder with config.json whose weights are drawn at random
    weights_seed: int
    engine: dict[str, Any] = field(default_factory=dict)
    static_batch_size: int | None = None
    peer_num_prompts: int | None = None
    roofline: bool | None = None  # None: on for presets that ask for it, on a GPU
    roofline_batches: tuple[int, ...] = (1, 64, 256)
    roofline_input_len: int = 512
    roofline_steps: int = 32
    temperature: float = 0.0
    draws: str = "numpy"
    peers: str = "all"

    def describe(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["random_weights"] = str(self.random_weights) if self.random_weights else None
        return out


def configs_dir() -> Path:
    """``benchmarks/configs`` of the working directory, else of the source tree."""
    if CONFIGS_DIR.is_dir():
        return CONFIGS_DIR
    return Path(__file__).resolve().parents[4] / CONFIGS_DIR


def resolve_workload(args: argparse.Namespace, model_given: bool) -> Workload:
    """The workload of the command line: a preset, with the options given on top. A preset runs
    its model on random weights unless a model was given (then its weights are used)."""
    preset = PRESETS[args.workload] if args.workload else None

    def pick(value: Any, from_preset: Any, default: Any) -> Any:
        if value is not None:
            return value
        return from_preset if preset is not None else default

    out_lo = args.min_output_len if args.min_output_len is not None else args.output_len
    out_hi = args.max_output_len if args.max_output_len is not None else args.output_len
    p = preset
    random_weights = args.random_weights
    if random_weights is None and p is not None and not model_given:
        random_weights = str(configs_dir() / p.config)
    wl = Workload(
        name=args.workload or "custom",
        num_prompts=pick(args.num_prompts, p and p.num_prompts, 64),
        input_len=(
            pick(args.min_input_len, p and p.input_len[0], 32),
            pick(args.max_input_len, p and p.input_len[1], 512),
        ),
        output_len=(
            pick(out_lo, p and p.output_len[0], 128),
            pick(out_hi, p and p.output_len[1], 128),
        ),
        dataset_seed=args.dataset_seed,
        random_weights=Path(random_weights) if random_weights else None,
        weights_seed=args.weights_seed,
        engine=dict(p.engine) if p else {},
        static_batch_size=pick(args.static_batch_size, p and p.static_batch_size, None),
        peer_num_prompts=pick(args.peer_num_prompts, p and p.peer_num_prompts, None),
        roofline=args.roofline,
        roofline_batches=pick(args.roofline_batches, p and p.roofline_batches, (1, 64, 256)),
        roofline_input_len=pick(args.roofline_input_len, p and p.roofline_input_len, 512),
        roofline_steps=pick(args.roofline_steps, p and p.roofline_steps, 32),
        temperature=pick(getattr(args, "temperature", None), p and p.temperature, 0.0),
        draws=p.draws if p else "numpy",
        peers=pick(getattr(args, "peers", None), p and p.peers, "all"),
    )
    if wl.roofline is None and not (p and p.roofline):
        wl.roofline = False
    for what, (lo, hi) in (("input", wl.input_len), ("output", wl.output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{what} lengths [{lo}, {hi}]: need 1 <= min <= max")
    if wl.draws == "nano" and (wl.input_len, wl.output_len) != (p.input_len, p.output_len):
        raise ValueError(
            "the nano workload's lengths are nano-vllm's (100..1024 in and out); change "
            "--num-prompts or --dataset-seed only"
        )
    if wl.num_prompts < 1:
        raise ValueError(f"--num-prompts {wl.num_prompts}: need at least one request")
    return wl


def make_prompts(
    n: int, lo: int, hi: int, vocab: int, seed: int | list[int], avoid: set[int]
) -> list[list[int]]:
    """``n`` prompts of random token ids (none in ``avoid``), lengths uniform in [lo, hi]."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab), np.fromiter(avoid, dtype=np.int64, count=len(avoid)))
    lens = rng.integers(lo, hi + 1, size=n)
    return [rng.choice(allowed, size=int(k)).tolist() for k in lens]


def nano_draws(
    n: int, seed: int, lo: int = 100, hi: int = 1024, vocab_hi: int = 10000
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py workload: with Python's ``random.seed(seed)``, ``n`` prompts of
    ``randint(lo, hi)`` ids each ``randint(0, vocab_hi)``, then ``n`` output lengths
    ``randint(lo, hi)``, in that order (seed 0, n 256: 133,966 output tokens)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab_hi) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [rng.randint(lo, hi) for _ in range(n)]


def make_output_lens(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """Output lengths uniform in [lo, hi], from their own stream so the prompts of a seed do not
    depend on the output range."""
    rng = np.random.default_rng([seed, 1])
    return rng.integers(lo, hi + 1, size=n).tolist()
