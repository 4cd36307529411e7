"""The ``pagoda`` command: generate, serve, plugins, config, bench.

Every command that builds an engine takes the same engine arguments (:func:`add_engine_args`):
``--config FILE`` and one flag per configuration key, turned into an :class:`EngineConfig` by
:func:`config_from_args` with the documented precedence (flags over environment over file).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
import typing
from importlib import metadata
from typing import Any

from pagoda.config import ConfigError, EngineConfig, plugin_settings
from pagoda.config.loader import flat_names, format_effective, sections
from pagoda.cpu_threads import set_wait_policy
from pagoda.version import __version__

logger = logging.getLogger("pagoda.cli")

_DEST = "cfg__"
_PLUGIN_DEST = "plugin_settings"
_SPEC_JSON = "speculative_config_json"
# Sections that mean nothing to a command that runs no server.
OFFLINE_SKIP = ("server",)


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add ``--config`` and a flag per configuration key (``--block-size``, ...) to ``parser``,
    except the keys of the sections in ``skip``."""
    parser.add_argument(
        "--config", metavar="FILE", help="YAML or TOML file with the engine configuration"
    )
    group = parser.add_argument_group("engine configuration (flags override environment and file)")
    secs = sections()
    for flat, (section, key) in flat_names().items():
        if section in skip:
            continue
        field = secs[section].model_fields[key]
        flag = "--" + flat.replace("_", "-")
        common: dict[str, Any] = {
            "dest": f"{_DEST}{section}__{key}",
            "default": None,
            "help": f"{field.description or ''} [{section}.{key}]{_default_text(field)}".strip(),
        }
        if field.annotation is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        elif field.annotation == list[str]:  # --lora-modules a=PATH b=PATH
            group.add_argument(flag, nargs="+", metavar="VALUE", **common)
        else:
            group.add_argument(flag, metavar=_metavar(field.annotation), **common)
    group.add_argument(
        "--plugin-setting",
        dest=_PLUGIN_DEST,
        action="append",
        default=None,
        metavar="NAME.KEY=VALUE",
        help="a plugin's setting, plugins.NAME.KEY (`pagoda config` lists them); repeatable",
    )
    if "speculative" not in skip:
        group.add_argument(
            "--speculative-config",
            dest=_SPEC_JSON,
            metavar="JSON",
            default=None,
            help="the speculative section as JSON, as vLLM takes it, e.g. '{\"method\": \"ngram\","
            " \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'; a per-key flag wins",
        )


def _default_text(field: Any) -> str:
    """`` (default: 16)`` for a key with a plain default (flags themselves default to None, so
    that only the flags given override the file and the environment)."""
    default = field.get_default()
    if default is None or isinstance(default, (dict, list)):
        return ""
    return f" (default: {json.dumps(default)})"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default where it has one worth saying (not None, not a bare switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return action.help or ""
        return super()._get_help_string(action)


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
    out.update(plugin_settings.flag_values(getattr(args, _PLUGIN_DEST, None) or []))
    spec = getattr(args, _SPEC_JSON, None)
    if spec is not None:
        for key, value in _json_object(spec, "--speculative-config").items():
            out.setdefault(f"speculative.{key}", (value, "--speculative-config"))
    return out


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"invalid configuration:\n  {flag}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"invalid configuration:\n  {flag}: want a JSON object, got {text!r}")
    return value


def config_from_args(
    args: argparse.Namespace, overrides: dict[str, Any] | None = None
) -> EngineConfig:
    """The engine configuration of a command: ``--config``, environment, flags, ``overrides``."""
    return EngineConfig.load(args.config, overrides, flags=_flags(args))


def _cmd_generate(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    # NOTE: torch, the engine and the server load only for the command that needs them.
    from pagoda import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    start = time.perf_counter()
    llm = _start_engine(LLM, config)
    tokenizer = llm.get_tokenizer()
    use_chat = (
        args.chat if args.chat is not None else bool(getattr(tokenizer, "chat_template", None))
    )
    prompts = args.prompts
    gen_start = time.perf_counter()
    # One batch: the engine runs every prompt at once; a bar shows progress for several.
    bar = not getattr(args, "quiet", False)
    if use_chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=bar)
    else:
        outs = llm.generate(prompts, params, use_tqdm=bar)
    done = time.perf_counter()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    logger.info(
        "generated %d tokens for %d prompt%s in %.2f s (%.2f s since start)",
        generated,
        len(prompts),
        "s" if len(prompts) > 1 else "",
        done - gen_start,
        done - start,
    )
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        print(_format_answer(i, len(prompts), prompt, out, args.json), flush=True)
    if args.stats:
        print(llm.spec_decoding_stats().summary(), file=sys.stderr, flush=True)
    return 0


def _start_engine(llm_cls: Any, config: EngineConfig) -> Any:
    """Build the engine, logging each start-up phase with its time."""
    model = config.model.model or "the default model"
    logger.info("starting the engine for %s", model)
    start = time.perf_counter()
    llm = llm_cls(config=config)
    core = getattr(llm.engine, "engine_core", None)
    times = getattr(core, "startup_times", {})
    if "load_weights_s" in times:
        logger.info("model loaded in %.2f s", times["load_weights_s"])
    if "kv_cache_s" in times:
        blocks = getattr(core, "num_blocks", 0)
        logger.info(
            "KV cache of %d blocks (%d tokens) allocated in %.2f s",
            blocks,
            blocks * config.cache.block_size,
            times["kv_cache_s"],
        )
    logger.info("ready in %.2f s", time.perf_counter() - start)
    return llm


ANSWER_SEPARATOR = "=" * 20


def _format_answer(i: int, n: int, prompt: str, out: Any, as_json: bool) -> str:
    """One answer: its text alone for a single prompt, under a separator line naming the prompt
    for several; or one JSON line."""
    c = out.outputs[0]
    if as_json:
        return json.dumps(
            {
                "index": i,
                "prompt": prompt,
                "text": c.text,
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": len(c.token_ids),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            },
            ensure_ascii=False,
        )
    if n == 1:
        return c.text
    shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
    head = f"{ANSWER_SEPARATOR} [{i + 1}/{n}] {shown!r} {ANSWER_SEPARATOR}"
    return f"{head}\n{c.text}" + ("\n" if i + 1 < n else "")


def _cmd_plugins(args: argparse.Namespace) -> int:
    # NOTE: torch, the engine and the server load only for the command that needs them.
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
    served = True
    if args.model is not None:
        text, served = _model_impl_report(args.model)
        print("\n" + text)
    return 1 if (args.check and has_problems()) or not served else 0


def _model_impl_report(model: str) -> tuple[str, bool]:
    """Which model impl would serve ``model`` (under ``model.impl=auto``) and each impl's
    verdict; False when none accepts it."""
    # NOTE: the loader (torch) and the model impls load only when --model asks for them.
    from pagoda.loader import load_hf_config, resolve_model
    from pagoda.models.impl import named_architecture, select_model_impl, verdicts

    hf_config = load_hf_config(resolve_model(model, "dummy").hf_dir)  # the config, no weights
    arch = named_architecture(hf_config) or "(none named)"
    try:
        chosen, _ = select_model_impl("auto", hf_config)
        head = f"model {model} (architecture {arch}): served by model impl {chosen!r} (auto)"
    except ValueError:
        chosen, head = None, f"model {model} (architecture {arch}): no model impl accepts it"
    rows = [("MODEL IMPL", "PRIORITY", "VERDICT")]
    for name, priority, reason in verdicts(hf_config):
        verdict = "accepts" if reason is None else f"refuses: {reason}"
        if name == chosen:
            verdict += " (chosen)"
        rows.append((name, "-" if priority is None else str(priority), verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:2], widths)) + "  " + r[2] for r in rows]
    return "\n".join([head, *lines]), chosen is not None


def _cmd_config(args: argparse.Namespace) -> int:
    print(format_effective(config_from_args(args), args.format))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    # NOTE: torch, the engine and the server load only for the command that needs them.
    from pagoda.bench.throughput import run_throughput

    return run_throughput(args, config_from_args(args))


def _cmd_bench_embed(args: argparse.Namespace) -> int:
    # NOTE: torch, the engine and the server load only for the command that needs them.
    from pagoda.bench.embed import run_embed

    return run_embed(args, config_from_args(args))


def _cmd_serve(args: argparse.Namespace) -> int:
    # NOTE: torch, the engine and the server load only for the command that needs them.
    from pagoda.entrypoints.openai.api_server import run_server

    overrides = {"model": args.model_arg} if args.model_arg else None
    return run_server(config_from_args(args, overrides))


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    # NOTE: torch, the engine and the server load only for the command that needs them.
    from pagoda.bench.serve import run_bench_serve

    return run_bench_serve(args)


def _version() -> str:
    try:
        return metadata.version("pagoda-core")
    except metadata.PackageNotFoundError:
        return __version__


def build_parser() -> argparse.ArgumentParser:
    # --debug and --quiet work before and after the command (SUPPRESS: a subcommand's default
    # does not undo the top level's flag).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log at DEBUG and show the traceback of an error",
    )
    common.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log warnings and errors only (no start-up phases)",
    )
    parser = argparse.ArgumentParser(
        prog="pagoda", description="Pagoda LLM engine", parents=[common]
    )
    parser.add_argument("--version", action="version", version=f"pagoda {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="generate text for one or more prompts",
        description="Generate an answer for each PROMPT, all in one batch. Several answers are "
        f"printed each under a line '{ANSWER_SEPARATOR} [i/n] PROMPT {ANSWER_SEPARATOR}'.",
        parents=[common],
        formatter_class=_HelpFormatter,
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: when the model has one)",
    )
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1: off")
    gen.add_argument("--top-k", type=int, default=0, help="0: off")
    gen.add_argument(
        "--sampling-seed", dest="seed", type=int, default=None, help="seed of the sampler"
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="print one JSON line per answer (text, token counts, finish reason)",
    )
    gen.add_argument(
        "--stats",
        action="store_true",
        help="print the engine's counters at the end (speculative decoding's acceptance)",
    )
    add_engine_args(gen, skip=OFFLINE_SKIP)
    gen.set_defaults(func=_cmd_generate)

    plugins = sub.add_parser(
        "plugins", help="list plugins, what they register, load errors", parents=[common]
    )
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.add_argument(
        "--check", action="store_true", help="exit with status 1 if any plugin failed to load"
    )
    plugins.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="also say which model impl would serve this model (folder or GGUF file) and why",
    )
    plugins.set_defaults(func=_cmd_plugins)

    config = sub.add_parser(
        "config",
        help="print the effective configuration and where each value came from",
        parents=[common],
    )
    config.add_argument("--format", choices=("table", "yaml", "json"), default="table")
    add_engine_args(config)
    config.set_defaults(func=_cmd_config)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server", parents=[common])
    serve.add_argument(
        "model_arg", nargs="?", metavar="MODEL", help="model folder or .gguf file (as --model)"
    )
    add_engine_args(serve)
    serve.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks", parents=[common])
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput against transformers")
    # NOTE: torch, the engine and the server load only for the command that needs them.
    from pagoda.bench.throughput import add_throughput_args

    add_throughput_args(tp)
    add_engine_args(tp)
    tp.set_defaults(func=_cmd_bench)
    emb = bench_sub.add_parser("embed", help="embedding throughput against sentence-transformers")
    # NOTE: torch, the engine and the server load only for the command that needs them.
    from pagoda.bench.embed import add_embed_args

    add_embed_args(emb)
    add_engine_args(emb, skip=OFFLINE_SKIP)
    emb.set_defaults(func=_cmd_bench_embed)
    bs = bench_sub.add_parser("serve", help="a request workload against a running server")
    # NOTE: torch, the engine and the server load only for the command that needs them.
    from pagoda.bench.serve import add_serve_args

    add_serve_args(bs)
    bs.set_defaults(func=_cmd_bench_serve)
    return parser


def configure_logging(debug: bool = False, quiet: bool = False) -> None:
    """Pagoda's loggers to stderr: INFO (start-up phases with their times), DEBUG with
    ``--debug``, WARNING with ``--quiet``; other libraries' loggers stay at WARNING."""
    level = logging.DEBUG if debug else logging.WARNING if quiet else logging.INFO
    log = logging.getLogger("pagoda")
    log.setLevel(level)
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s %(message)s", datefmt="%H:%M:%S")
        )
        log.addHandler(handler)
    log.propagate = False


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors a user can act on: bad configuration or input, a missing file or plugin."""
    # NOTE: torch, the engine and the server load only for the command that needs them.
    from pagoda.plugins import PluginError

    # NOTE: RequestRejectedError (an admission rule refused a prompt) is a ValueError.
    return (ConfigError, PluginError, ValueError, KeyError, OSError)


def _one_line(e: BaseException) -> str:
    """The error's message on one line: its lines joined, any traceback it quotes left out."""
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    lines: list[str] = []
    cut = False
    for line in text.strip().splitlines():
        if line.startswith("Traceback (most recent call last)"):
            cut = True
            break
        if line.strip():
            lines.append(line.strip())
    out = lines[0] if lines else type(e).__name__
    for line in lines[1:]:
        out += (" " if out.endswith(":") else "; ") + line
    return out + (" (--debug shows the traceback)" if cut else "")


def main(argv: list[str] | None = None) -> int:
    """The ``pagoda`` command. A foreseeable error (configuration, input, missing model or
    plugin) is one line on stderr and exit status 2; ``--debug`` shows its traceback."""
    set_wait_policy()  # before any command loads torch (pagoda.cpu_threads)
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    configure_logging(debug, getattr(args, "quiet", False))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("pagoda: interrupted", file=sys.stderr)
        return 130
    except _user_errors() as e:
        if debug:
            traceback.print_exc()
        print(f"pagoda: error: {_one_line(e)}", file=sys.stderr)
        return 2
    # NOTE: anything else is a defect, and its traceback is what a bug report needs.


if __name__ == "__main__":
    sys.exit(main())
