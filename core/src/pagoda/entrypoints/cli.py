"""The ``pagoda`` command: generate, serve, plugins, config, bench.

Every command that builds an engine takes the same engine arguments (:func:`add_engine_args`):
``--config FILE`` and one flag per configuration key, turned into an :class:`EngineConfig` by
:func:`config_from_args` with the documented precedence (flags over environment over file).
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from typing import Any

from pagoda.config import ConfigError, EngineConfig
from pagoda.config.loader import flat_names, format_effective, sections

_DEST = "cfg__"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and a flag per configuration key (``--block-size``, ...) to ``parser``."""
    parser.add_argument(
        "--config", metavar="FILE", help="YAML or TOML file with the engine configuration"
    )
    group = parser.add_argument_group("engine configuration (flags override environment and file)")
    secs = sections()
    for flat, (section, key) in flat_names().items():
        field = secs[section].model_fields[key]
        flag = "--" + flat.replace("_", "-")
        common: dict[str, Any] = {
            "dest": f"{_DEST}{section}__{key}",
            "default": None,
            "help": f"{field.description or ''} [{section}.{key}]".strip(),
        }
        if field.annotation is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        else:
            group.add_argument(flag, metavar=_metavar(field.annotation), **common)


def _metavar(annotation: Any) -> str:
    literals = [a for a in typing.get_args(annotation) if isinstance(a, str)]
    return "{" + ",".join(literals) + "}" if literals else "VALUE"


def _flags(args: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """``section.key`` -> (value, flag) for every engine flag given on the command line."""
    names = {v: k for k, v in flat_names().items()}
    out = {}
    for dest, value in vars(args).items():
        if dest.startswith(_DEST) and value is not None:
            section, key = dest[len(_DEST) :].split("__")
            out[f"{section}.{key}"] = (value, "--" + names[(section, key)].replace("_", "-"))
    return out


def config_from_args(
    args: argparse.Namespace, overrides: dict[str, Any] | None = None
) -> EngineConfig:
    """The engine configuration of a command: ``--config``, environment, flags, ``overrides``."""
    return EngineConfig.load(args.config, overrides, flags=_flags(args))


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagoda import LLM, SamplingParams

    llm = LLM(config=config_from_args(args))
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
    from pagoda.plugins import reload_plugins
    from pagoda.plugins.report import format_plugins, has_problems

    # The report shows every failure in full; the discovery warnings would only repeat it.
    log = logging.getLogger("pagoda.plugins")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        reload_plugins()  # what is installed now, even if this process discovered plugins before
    finally:
        log.setLevel(level)
    print(format_plugins("json" if args.json else "table"))
    return 1 if args.check and has_problems() else 0


def _cmd_config(args: argparse.Namespace) -> int:
    print(format_effective(config_from_args(args), args.format))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pagoda.bench.throughput import run_throughput

    return run_throughput(args, config_from_args(args))


def _cmd_serve(args: argparse.Namespace) -> int:
    from pagoda.entrypoints.openai.api_server import run_server

    overrides = {"model": args.model_arg} if args.model_arg else None
    return run_server(config_from_args(args, overrides))


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from pagoda.bench.serve import run_bench_serve

    return run_bench_serve(args)


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

    plugins = sub.add_parser("plugins", help="list plugins, what they register, load errors")
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.add_argument(
        "--check", action="store_true", help="exit with status 1 if any plugin failed to load"
    )
    plugins.set_defaults(func=_cmd_plugins)

    config = sub.add_parser(
        "config", help="print the effective configuration and where each value came from"
    )
    config.add_argument("--format", choices=("table", "yaml", "json"), default="table")
    add_engine_args(config)
    config.set_defaults(func=_cmd_config)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument(
        "model_arg", nargs="?", metavar="MODEL", help="model folder or .gguf file (as --model)"
    )
    add_engine_args(serve)
    serve.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput against transformers")
    from pagoda.bench.throughput import add_throughput_args

    add_throughput_args(tp)
    add_engine_args(tp)
    tp.set_defaults(func=_cmd_bench)
    bs = bench_sub.add_parser("serve", help="a request workload against a running server")
    from pagoda.bench.serve import add_serve_args

    add_serve_args(bs)
    bs.set_defaults(func=_cmd_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagoda.plugins import PluginError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, PluginError, ValueError, KeyError) as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
