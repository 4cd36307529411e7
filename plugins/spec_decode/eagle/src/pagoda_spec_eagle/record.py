"""Generate with Pagoda and record the target's hidden states: the data an EAGLE-3 head trains
on. A proposer that drafts nothing receives, through the proposer contract, the hidden states
of EAGLE-3's three layers and of the last layer for every position the target computes."""

from __future__ import annotations

import ast
import functools
import os
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagoda import LLM, SamplingParams, hookimpl
from pagoda.plugins import plugin_registered
from pagoda.spec_decode import Drafts, ProposalBatch, SpeculativeProposer, TargetModel
from pagoda_spec_eagle.proposer import default_aux_layers

RECORDER = "eagle3-recorder"
_ACTIVE: list[HiddenRecorder] = []  # the recorder of the engine in this process


class HiddenRecorder(SpeculativeProposer):
    needs_hidden_states = True

    def bind_target(self, target: TargetModel) -> None:
        n = target.num_hidden_layers
        self.aux_layers = default_aux_layers(n)
        # The three layers, then the stream after the last layer (before the final norm).
        self.hidden_state_layers = (*self.aux_layers, n)
        self.target = target
        # NOTE: each call's rows are the step's own tensor (the runner keeps none of it), kept
        # as they come; no per-request work while the engine runs.
        self.steps: list[tuple[list[str], np.ndarray, np.ndarray, torch.Tensor]] = []
        _ACTIVE[:] = [self]

    def propose(self, batch: ProposalBatch) -> Drafts:
        self.steps.append(
            (batch.req_ids, batch.num_tokens.copy(), batch.hidden_loc, batch.new_hidden_states)
        )
        return Drafts.empty(len(batch))

    def sequences(self) -> dict[str, torch.Tensor]:
        """Each request's rows from position 0 on, joined (requests whose rows do not start
        at 0 or have a gap are left out)."""
        parts: dict[str, list[torch.Tensor]] = {}
        starts: dict[str, int] = {}
        ends: dict[str, int] = {}
        for req_ids, num_tokens, loc, rows in self.steps:
            m = np.diff(loc)
            firsts = (num_tokens - 1 - m).tolist()
            for i, (req_id, first) in enumerate(zip(req_ids, firsts)):
                if not m[i]:
                    continue
                if first == 0 or ends.get(req_id) != first:  # a new or recomputed request
                    parts[req_id], starts[req_id] = [], first
                parts[req_id].append(rows[loc[i] : loc[i + 1]])
                ends[req_id] = first + int(m[i])
        self.steps.clear()
        return {r: torch.cat(p) for r, p in parts.items() if starts[r] == 0}


class _RecorderPlugin:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_spec_proposers(self, register) -> None:
        register(RECORDER, HiddenRecorder)


@dataclass
class Recorded:
    """One sequence: its tokens and, for positions 0..len - 2, the three layers' hidden states
    [n - 1, 3H] and the target's final hidden state [n - 1, H] (normed)."""

    tokens: torch.Tensor  # [n] int64
    num_prompt: int
    aux: torch.Tensor
    final: torch.Tensor


# ---- the corpus: text that ships with Python -----------------------------------------------------

_ASKS = [
    "Explain what the following Python documentation describes, in a few sentences:\n\n{}",
    "Summarise this text from the Python standard library:\n\n{}",
    "Write a short example that uses what this describes:\n\n{}",
    "What is this Python code for? Answer briefly.\n\n{}",
    "List the main ideas of this text:\n\n{}",
]

# Folders of the standard library left out: tests, GUIs and demos, the installers' payloads.
_SKIP_DIRS = {"idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
              "dist-packages", "__pycache__", "__phello__"}  # fmt: skip


@functools.cache
def _texts() -> tuple[str, ...]:
    """The standard library's documentation and code, read from its source files (parsed, not
    imported: no module runs): the docstring of every module, class and function longer than
    80 characters, under its qualified name, and the source of every public function with a
    shorter one or none; in the order of the sorted file paths."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d for d in dirs if d not in _SKIP_DIRS and not d.startswith(("test", "config-"))
        )
        for name in sorted(files):
            if not name.endswith(".py") or name.startswith("test"):
                continue
            path = Path(folder, name)
            parts = path.relative_to(root).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            texts += _file_texts(path.read_text(encoding="utf-8", errors="replace"), module)
    return tuple(texts)


def _file_texts(source: str, module: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out: list[str] = []
    lines = source.splitlines(keepends=True)

    def visit(node: ast.AST, prefix: str) -> None:
        doc = ast.get_docstring(node)  # type: ignore[arg-type]
        if doc and len(doc) > 80:
            out.append(f"{prefix}: {doc}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not node.name.startswith("_"):
                code = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
                if len(code) > 80:
                    out.append(code)
        for child in node.body:  # type: ignore[attr-defined]
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{prefix}.{child.name}")

    visit(tree, module)
    return out


HELD_OUT_TEXTS = 64  # texts no training message uses, for held-out figures


def corpus(
    n: int, seed: int = 0, *, heldout: bool = False, skip: int = 0, max_chars: int = 600
) -> list[str]:
    """``n`` user messages built from the docstrings and sources of the standard library
    (``_texts``), under a few instructions. Training messages (the default) are
    the (text, instruction) pairs of every text but ``HELD_OUT_TEXTS`` of them, in a fixed
    shuffled order; held-out messages (``heldout=True``) use those texts only, from the
    ``skip``-th on, one instruction each."""
    # Texts that are the same once cut (copied code, shared docstrings) count once: a held-out
    # message must not be a training one.
    texts = list(dict.fromkeys(t[:max_chars] for t in _texts()))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(texts))
    train, held = order[:-HELD_OUT_TEXTS], order[-HELD_OUT_TEXTS:]
    if heldout:
        if skip + n > len(held):
            raise ValueError(f"only {len(held)} held-out texts; asked for {skip} + {n}")
        asks = rng.integers(len(_ASKS), size=len(held))
        picks = [(int(held[i]), int(asks[i])) for i in range(skip, skip + n)]
    else:
        pairs = [(int(t), a) for t in train for a in range(len(_ASKS))]
        perm = rng.permutation(len(pairs))
        picks = [pairs[perm[i % len(pairs)]] for i in range(n)]
    return [_ASKS[a].format(texts[t]) for t, a in picks]


def encode_prompts(llm: LLM, messages: list[str]) -> list[list[int]]:
    """Token ids of each message through the model's chat template, or of the plain text for a
    model without one."""
    engine = llm.engine
    out = []
    for text in messages:
        try:
            prompt: Any = engine.apply_chat_template([{"role": "user", "content": text}])
        except Exception:
            prompt = text
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids")
            prompt = prompt.get("prompt") if ids is None else ids
        if isinstance(prompt, str):
            prompt = llm.get_tokenizer().encode(prompt)
        out.append(list(prompt))
    return out


def generate_and_record(
    engine_args: dict[str, Any],
    messages: list[str],
    num_train: int,
    max_tokens: int,
    progress: bool = True,
) -> tuple[list[Recorded], TargetModel, list[list[int]]]:
    """Greedy continuations of the first ``num_train`` messages by the model, with the hidden
    states the target computed for them (prefix caching off, so every position is computed);
    also the token ids of the other messages (held out)."""
    args = {**engine_args, "enable_prefix_caching": False}
    # NOTE: no governor: with drafting off the recorder would not be called (every step counts).
    args["speculative_config"] = {
        "method": RECORDER,
        "num_speculative_tokens": 1,
        "adaptive": False,
    }
    with plugin_registered(_RecorderPlugin(), "pagoda-eagle3-recorder"):
        llm = LLM(**args)
        room = int(engine_args.get("max_model_len") or 2048) - max_tokens - 8
        all_prompts = [p[-room:] for p in encode_prompts(llm, messages)]
        prompts, heldout = all_prompts[:num_train], all_prompts[num_train:]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress)
    rec = _ACTIVE.pop()
    model = rec.target.model
    h = model.config.hidden_size
    recorded = rec.sequences()
    data = []
    for out in outs:
        req_id = out.request_id
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        if req_id not in recorded:
            continue
        rows = recorded.pop(req_id)[: len(tokens) - 1]
        with torch.inference_mode():
            final = model.model.norm(rows[:, 3 * h :].contiguous())
        data.append(
            Recorded(
                torch.tensor(tokens[: len(rows) + 1]),
                len(out.prompt_token_ids),
                rows[:, : 3 * h].clone(),
                final.clone(),
            )
        )
    target = rec.target
    del llm, rec
    return data, target, heldout
