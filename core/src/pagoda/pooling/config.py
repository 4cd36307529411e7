"""A model's pooling config: the tasks it serves and how it pools, from its architecture, its
sentence-transformers files (``modules.json``, ``1_Pooling/config.json``) and ``model.task``.

The rules, in the order they apply:

- The architecture fixes the head: ``*ForCausalLM`` has an LM head (it generates),
  ``*ForSequenceClassification`` a classifier (``classify``; ``score`` when it has one label, a
  cross-encoder), anything else (``BertModel``, ``Qwen3Model``, ...) only hidden states (``embed``).
- ``model.task``: ``auto`` serves what the head serves, plus ``embed`` for a causal LM that ships a
  sentence-transformers pipeline (Qwen3-Embedding, GTE-Qwen2); ``generate`` only generation;
  ``embed`` embeddings, and generation too where the model has an LM head (one engine for chat and
  embeddings); ``classify``/``score`` the classifier's tasks. A task the head cannot serve is an
  error naming both.
- Embeddings pool as the sentence-transformers pipeline says (its pooling mode, and ``Normalize``
  when the pipeline has one); without one, a bidirectional encoder pools its first token (CLS),
  a causal model its last, and embeddings are normalised (vLLM's defaults). ``token_embed`` keeps
  every token's (late interaction), each normalised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pagoda.pooling_params import PoolingParams

#: The tasks an engine can serve; the pooling ones are those of ``pagoda.pooling_params``.
TASKS = ("auto", "generate", "embed", "classify", "score")

# sentence-transformers' pooling modes (old boolean keys and the newer ``pooling_mode``).
_ST_MODES = {
    "cls": "CLS",
    "mean": "MEAN",
    "lasttoken": "LAST",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_ST_UNSUPPORTED = (
    "max",
    "mean_sqrt_len_tokens",
    "weightedmean",
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True)
class PoolerConfig:
    """How a model pools, resolved once (``ModelInfo.pooler``); the runner builds its poolers
    from it and the engine resolves each request's ``PoolingParams`` with it."""

    #: The pooling tasks served (``pagoda.pooling_params.POOLING_TASKS``).
    tasks: tuple[str, ...]
    #: How ``embed`` pools (``LAST``, ``CLS``, ``MEAN``).
    pooling_type: str
    #: Whether embeddings are L2-normalised unless a request says otherwise.
    normalize: bool
    #: The width of an embedding (the hidden size).
    hidden_size: int
    #: How the classifier head pools (``classify``/``score``); its labels (0: no classifier).
    classifier_pooling: str = "CLS"
    num_labels: int = 0
    #: Where the sentence-transformers pipeline came from, for messages (None: defaults).
    source: str | None = None

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """A copy of ``params`` (whose ``task`` is set) checked against this model and filled
        in: the pooling type, ``normalize``, ``activation``. Raises ``ValueError`` naming the
        field for a task the model lacks or ``dimensions`` wider than its embeddings."""
        task = params.task or "embed"
        if task not in self.tasks:
            raise ValueError(
                f"PoolingParams.task={task!r}: this model serves {', '.join(self.tasks)} "
                "(model.task / --task chooses among what its head can do)"
            )
        if params.dimensions is not None:
            if task not in ("embed", "token_embed"):
                raise ValueError(
                    f"PoolingParams.dimensions: only embeddings have dimensions, not task {task!r}"
                )
            if params.dimensions > self.hidden_size:
                raise ValueError(
                    f"PoolingParams.dimensions={params.dimensions}: more than the model's "
                    f"{self.hidden_size} embedding dimensions"
                )
        if task in ("classify", "score"):
            kind = self.classifier_pooling
        elif task == "token_embed":
            kind = "ALL"
        else:
            kind = self.pooling_type
        normalize = self.normalize if params.normalize is None else params.normalize
        if task == "token_embed" and params.normalize is None:
            normalize = True
        activation = True if params.activation is None else params.activation
        return replace(
            params, task=task, pooling_type=kind, normalize=normalize, activation=activation
        )


def head_of(architecture: str) -> str:
    """``lm``, ``classifier`` or ``base``: what the architecture's name says its head is."""
    # (``*ForConditionalGeneration``: a vision-language model's name; it generates text.)
    if architecture.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")):
        return "lm"
    if architecture.endswith("ForSequenceClassification"):
        return "classifier"
    return "base"


def resolve_pooler(
    task: str,
    architecture: str,
    hf_dir: str | Path,
    hf_config: dict[str, Any],
    hidden_size: int,
    causal: bool,
) -> tuple[tuple[str, ...], PoolerConfig | None]:
    """The tasks an engine serves (``generate`` among them where it generates) and its pooling
    config (None: a generation-only engine). Raises ``ValueError`` naming ``model.task`` when the
    model cannot serve the task asked."""
    if task not in TASKS:
        raise ValueError(f"model.task={task!r}: want one of {', '.join(TASKS)}")
    head = head_of(architecture)
    st = read_sentence_transformers(hf_dir)
    default_type = "LAST" if causal else "CLS"
    pooling_type, normalize, source = default_type, True, None
    if st is not None:
        pooling_type, normalize, source = st
    if head == "classifier":
        if task not in ("auto", "classify", "score"):
            raise ValueError(
                f"model.task={task!r}: {architecture} has a classification head, which serves "
                "classify (and score with one label); not generate or embed"
            )
        labels = _num_labels(hf_config)
        tasks = ("classify", "score") if labels == 1 else ("classify",)
        if task == "score" and labels != 1:
            raise ValueError(
                f"model.task='score': {architecture} has {labels} labels; a cross-encoder's "
                "score needs exactly one"
            )
        cfg = PoolerConfig(
            tasks, pooling_type, normalize, hidden_size, default_type, labels, source
        )
        return tasks, cfg
    if task in ("classify", "score"):
        raise ValueError(
            f"model.task={task!r}: {architecture} has no sequence classification head "
            "(a *ForSequenceClassification architecture has one)"
        )
    pooling = PoolerConfig(("embed", "token_embed"), pooling_type, normalize, hidden_size,
                           source=source)  # fmt: skip
    if head == "lm":
        if task == "generate" or (task == "auto" and st is None):
            return ("generate",), None
        return ("generate", "embed", "token_embed"), pooling
    if task == "generate":
        raise ValueError(
            f"model.task='generate': {architecture} has no LM head (it serves embeddings); "
            "its *ForCausalLM checkpoint generates"
        )
    return pooling.tasks, pooling


def _num_labels(hf_config: dict[str, Any]) -> int:
    if hf_config.get("num_labels") is not None:
        return int(hf_config["num_labels"])
    labels = hf_config.get("id2label") or hf_config.get("label2id")
    return len(labels) if labels else 2


def read_sentence_transformers(hf_dir: str | Path) -> tuple[str, bool, str] | None:
    """(pooling type, normalize, where) from a sentence-transformers pipeline's files, or None
    where the folder has none. A pipeline this engine cannot reproduce (a ``Dense`` projection,
    max pooling, ...) raises ``ValueError`` naming the module."""
    root = Path(hf_dir)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_type, normalize = None, False
    for i, module in enumerate(modules):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer" and i == 0:
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling" and pooling_type is None:
            pooling_type = _st_pooling(root / module.get("path", ""), modules_file)
        else:
            raise ValueError(
                f"{modules_file}: module {i} ({module.get('type')}) is not supported; a pipeline "
                "of a Transformer, a Pooling and an optional Normalize is"
            )
    if pooling_type is None:
        raise ValueError(f"{modules_file} has no Pooling module")
    return pooling_type, normalize, str(modules_file)


def _st_pooling(folder: Path, modules_file: Path) -> str:
    cfg = json.loads((folder / "config.json").read_text())
    modes = cfg.get("pooling_mode")
    found = [modes] if isinstance(modes, str) else list(modes or [])
    found += [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    bad = [m for m in found if m in _ST_UNSUPPORTED or m not in _ST_MODES]
    if bad or len(found) != 1:
        raise ValueError(
            f"{folder / 'config.json'} (from {modules_file}): pooling {found!r} is not supported; "
            "one of cls, mean, lasttoken is"
        )
    return _ST_MODES[found[0]]
