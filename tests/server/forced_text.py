"""A test plugin (loaded through ``PAGODA_PLUGIN_MODULES``) whose logits processor makes a
request write a script of tokens: ``PAGODA_TEST_SCRIPTS`` is a JSON object of marker -> token
ids, and a request whose ``request_id`` holds a marker writes that marker's ids first, one per
step, then samples freely (under its grammar, if it has one). A script that ends with the EOS id
ends the output."""

from __future__ import annotations

import json
import os

import torch

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1
_SCRIPTS: dict[str, list[int]] = json.loads(os.environ.get("PAGODA_TEST_SCRIPTS", "{}"))
_steps: dict[str, int] = {}


def _script(req_id: str) -> list[int] | None:
    return next((ids for marker, ids in _SCRIPTS.items() if marker in req_id), None)


def _force(logits: torch.Tensor, md) -> torch.Tensor:
    for row, req_id in enumerate(md.req_ids or []):
        script = _script(req_id)
        if script is None:
            continue
        step = _steps.get(req_id, 0)
        _steps[req_id] = step + 1
        if step < len(script):
            logits[row].fill_(float("-inf"))
            logits[row, script[step]] = 0.0
    return logits


@hookimpl
def logits_processors(config, vocab_size, device):
    return [_force] if _SCRIPTS else None
