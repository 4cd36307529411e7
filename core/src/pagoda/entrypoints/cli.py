"""The ``pagoda`` command: generate, plugins, bench (and serve, config as they land)."""

from __future__ import annotations

import argparse
import sys
import typing
from typing import Any

from pagoda.config import ConfigError, EngineConfig


def _flag_specs() -> list[tuple[str, str, str, Any]]:
    """(flag, section, key, annotation) for every config key; flat names follow vLLM."""
    seen: dict[str, int] = {}
    fields = []
    for section, info in EngineConfig.model_fields.items():
        for key, f in info.annotation.model_fields.items():  # type: ignore[union-attr]
            seen[key] = seen.get(key, 0) + 1
            fields.append((section, key, f))
    specs = []
    for section, key, f in fields:
        name = (
            key if seen[key] == 1 and key != "model" or section == "model" else (f"{section}-{key}")
        )
        if section == "attention" and key == "backend":
            name = "attention-backend"
        specs.append((name.replace("_", "-"), section, key, f.annotation))
    return specs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or TOML file with the engine configuration")
    group = parser.add_argument_group("engine configuration (each overrides --config)")
    for flag, section, key, annotation in _flag_specs():
        dest = f"cfg__{section}__{key}"
        if annotation is bool:
            group.add_argument(
                f"--{flag}",
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{section}.{key}",
            )
        else:
            group.add_argument(
                f"--{flag}",
                dest=dest,
                default=None,
                metavar=_metavar(annotation),
                help=f"{section}.{key}",
            )


def _metavar(annotation: Any) -> str:
    args = typing.get_args(annotation)
    literals = [a for a in args if isinstance(a, str)]
    return "{" + ",".join(literals) + "}" if literals else "VALUE"


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for name, value in vars(args).items():
        if name.startswith("cfg__") and value is not None:
            _, section, key = name.split("__")
            nested.setdefault(section, {})[key] = value
    return nested


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagoda import LLM, SamplingParams

    llm = LLM(config=args.config, **engine_overrides(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    tokenizer = llm.get_tokenizer()
    use_chat = (
        args.chat if args.chat is not None else bool(getattr(tokenizer, "chat_template", None))
    )
    for prompt in args.prompts:
        if use_chat:
            out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
        else:
            out = llm.generate(prompt, params, use_tqdm=False)[0]
        print(out.outputs[0].text)
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    from pagoda.plugins import get_plugin_manager, get_registry
    from pagoda.plugins.hookspecs import all_registry_hooks

    get_plugin_manager()
    for kind in all_registry_hooks():
        reg = get_registry(kind)
        for name in reg.names():
            print(f"{kind:<20} {name:<24} {reg.entries[name].plugin}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pagoda.bench.throughput import run_throughput

    return run_throughput(args, engine_overrides(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: when the model has one)",
    )
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", dest="seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    plugins = sub.add_parser("plugins", help="list plugins and what they register")
    plugins.set_defaults(func=_cmd_plugins)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput against transformers")
    from pagoda.bench.throughput import add_throughput_args

    add_throughput_args(tp)
    add_engine_args(tp)
    tp.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, KeyError) as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
