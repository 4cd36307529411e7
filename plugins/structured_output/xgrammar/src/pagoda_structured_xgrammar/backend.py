"""The xgrammar backend: constraints become xgrammar grammars, compiled against the model's
vocabulary; a step's bitmask is filled by xgrammar's threads and applied by its kernels."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    apply_token_bitmask,
)

# xgrammar's errors start with a timestamp, a source file and an assertion: keep the message.
_NOISE = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*(Check failed:.*? is false:\s*)?")


def _message(e: Exception) -> str:
    return _NOISE.sub("", str(e)).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _grammar(params: StructuredOutputsParams, any_whitespace: bool) -> xgr.Grammar:
    kind = params.kind
    if kind in ("json", "json_object"):
        # NOTE: strict mode refuses properties a schema does not name (a valid subset of what
        # it allows); any object must allow them all.
        schema = params.json if kind == "json" else {"type": "object"}
        return xgr.Grammar.from_json_schema(
            json.dumps(schema),
            any_whitespace=any_whitespace,
            separators=None if any_whitespace else (",", ":"),
            strict_mode=kind == "json",
        )
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    if kind == "structural_tag":
        tag = json.loads(params.structural_tag)
        if not any_whitespace:
            tag = _compact_json(tag)
        return xgr.Grammar.from_structural_tag(json.dumps(tag))
    return xgr.Grammar.from_ebnf(params.grammar)


def _compact_json(node: Any) -> Any:
    """A structural tag whose JSON contents allow no whitespace between tokens (as
    ``any_whitespace`` false does for a JSON schema): each becomes the grammar of its schema."""
    if isinstance(node, list):
        return [_compact_json(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        schema = node["json_schema"]
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
        )
        return {"type": "grammar", "grammar": str(grammar)}
    return {k: _compact_json(v) for k, v in node.items()}


_WHAT = {
    "json": "invalid or unsupported JSON schema",
    "json_object": "invalid JSON object constraint",
    "regex": "invalid or unsupported regex",
    "choice": "invalid choice",
    "grammar": "invalid EBNF grammar",
    "structural_tag": "invalid structural tag",
}


def _build(params: StructuredOutputsParams, any_whitespace: bool) -> xgr.Grammar:
    try:
        return _grammar(params, any_whitespace)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{_WHAT[params.kind]}: {_message(e)}") from None


def mask_threads() -> int:
    """Threads that fill a batch's bitmasks: half the CPUs this process may run on, at most 8.
    NOTE: xgrammar's own default counts the host's CPUs, not the container's or the affinity
    mask's; on a 16-CPU slice of a large host it starts dozens of threads that then wait for
    each other. ``PAGODA_XGRAMMAR_MASK_THREADS`` sets the number."""
    if os.environ.get("PAGODA_XGRAMMAR_MASK_THREADS"):
        return max(1, int(os.environ["PAGODA_XGRAMMAR_MASK_THREADS"]))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


class XGrammarMatcher(GrammarMatcher):
    __slots__ = ("matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        # NOTE: xgrammar keeps an unbounded rollback history; no limit to pass.
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        m = self.matcher
        return all(m.accept_token(t) for t in tokens)

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        m = self.matcher
        n = 0
        for t in tokens:
            if not m.accept_token(t):
                break
            n += 1
        if n:
            m.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XGrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def new_matcher(self, max_rollback_tokens: int = 0) -> XGrammarMatcher:
        return XGrammarMatcher(self.compiled)

    def memory_bytes(self) -> int:
        return int(self.compiled.memory_size_bytes)


XGrammarCompiled.backend = None  # type: ignore[assignment]  # set below


class XGrammarBackend(GrammarBackend):
    priority = 10
    _batch: Any = None  # xgr.BatchGrammarMatcher, made on first use

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], config: Any
    ) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids, config)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=config.compile_threads)

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        _build(params, any_whitespace=True)

    def compile(self, params: StructuredOutputsParams) -> XGrammarCompiled:
        grammar = _build(params, self.config.any_whitespace)
        try:
            return XGrammarCompiled(self._compiler.compile_grammar(grammar))
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"{_WHAT[params.kind]}: {_message(e)}") from None

    @classmethod
    def fill_bitmasks(
        cls, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        if len(matchers) == 1:
            matchers[0].fill_bitmask(bitmask, rows[0])
            return
        if cls._batch is None:
            cls._batch = xgr.BatchGrammarMatcher(mask_threads())
        inner = [m.matcher for m in matchers]  # type: ignore[attr-defined]
        cls._batch.batch_fill_next_token_bitmask(inner, bitmask, list(rows))

    @classmethod
    def accept_batch(cls, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[bool]:
        inner = [m.matcher for m in matchers]  # type: ignore[attr-defined]
        return xgr.BatchGrammarMatcher.batch_accept_token(inner, list(tokens))

    @classmethod
    def apply_bitmask(cls, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        # xgrammar's kernels: Triton on a GPU, C++ on a CPU (about 2x the torch reference there).
        if (
            logits.device.type == "cuda"
            and len(rows) == logits.shape[0]
            and logits.dim() == 2
            and logits.is_contiguous()
            and _apply_every_row(logits, bitmask)
        ):
            return
        if logits.device.type in ("cuda", "cpu") and logits.is_contiguous():
            indices = None if len(rows) == logits.shape[0] else rows
            xgr.apply_token_bitmask_inplace(logits, bitmask[: logits.shape[0]], indices=indices)
        else:
            apply_token_bitmask(logits, bitmask, rows)


XGrammarCompiled.backend = XGrammarBackend

# xgrammar's Triton kernel, launched every constrained step through its compiled kernel
# (pagoda.ops.launch): its wrapper's checks and the JIT's dispatch cost the host about as much as
# the kernel runs, on a host-bound step. Used only where its parameters are the ones known here.
_APPLY_PARAMS = (
    "logits_ptr",
    "bitmask_ptr",
    "indices_ptr",
    "num_rows",
    "vocab_size",
    "logits_strides",
    "bitmask_strides",
    "NUM_SMS",
    "BLOCK_SIZE",
)
_APPLY_BLOCK = 4096
_apply_launch: Any = None  # a CachedLaunch, or False where xgrammar's kernel is not the one known
_num_sms: dict[int, int] = {}


def _apply_every_row(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """Mask every row of ``logits`` (CUDA, 2-D, contiguous) with ``bitmask``'s first rows
    (int32, on the same device); False if this path does not apply (the caller then goes
    through xgrammar's own entry point)."""
    global _apply_launch
    if _apply_launch is None:
        try:
            from xgrammar.kernels.apply_token_bitmask_inplace_triton import (
                apply_token_bitmask_inplace_kernel as kernel,
            )

            from pagoda.ops.launch import CachedLaunch

            known = tuple(kernel.arg_names) == _APPLY_PARAMS and torch.version.hip is None
            _apply_launch = CachedLaunch(kernel) if known else False
        except Exception:  # noqa: BLE001 - no Triton, another xgrammar: its entry point
            _apply_launch = False
    if _apply_launch is False or bitmask.dtype != torch.int32 or bitmask.device != logits.device:
        return False
    n = logits.shape[0]
    bm = bitmask[:n]
    vocab = min(logits.shape[1], bm.shape[1] * 32)
    dev = logits.device.index if logits.device.index is not None else torch.cuda.current_device()
    sms = _num_sms.get(dev)
    if sms is None:
        sms = _num_sms[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    key = (
        logits.dtype,
        dev,
        n,
        vocab,
        logits.stride(0),
        bm.stride(0),
        logits.data_ptr() % 16 == 0,
        bm.data_ptr() % 16 == 0,
    )
    _apply_launch(
        key,
        (sms,),
        (logits, bm, None, n, vocab, logits.stride(0), bm.stride(0), sms, _APPLY_BLOCK),
        num_warps=_APPLY_BLOCK // 32 // (16 // logits.element_size()),
        num_stages=3,
    )
    return True
