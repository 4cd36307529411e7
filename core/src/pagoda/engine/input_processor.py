"""Turns user prompts into token ids the core can run, and rejects what it cannot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.model_info import ModelInfo
from pagoda.models.bert import encode_token_types
from pagoda.multimodal import MediaLimits, MultiModalProcessor, load_image
from pagoda.multimodal_inputs import MultiModalInputs

PromptType = str | dict[str, Any]


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    # The prompt's images (``multi_modal_data``), processed; None: a text prompt.
    mm_inputs: MultiModalInputs | None = None


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        info: ModelInfo,
        mm_processor: MultiModalProcessor | None = None,
        mm_limits: dict[str, int] | None = None,
        media_limits: MediaLimits | None = None,
    ) -> None:
        """``mm_processor``: the model's multimodal processor (None: a text-only model, which
        refuses ``multi_modal_data``); ``mm_limits``: items per prompt by modality
        (``limit_mm_per_prompt``)."""
        self.tokenizer = tokenizer
        self.info = info
        self.mm_processor = mm_processor
        self.mm_limits = mm_limits if mm_limits is not None else {"image": 8}
        self.media_limits = media_limits or MediaLimits()

    def process(self, prompt: PromptType | ProcessedPrompt) -> ProcessedPrompt:
        """Tokenize and check a prompt; one with ``multi_modal_data`` has its images processed
        (call it off the event loop: the processor is CPU work)."""
        if isinstance(prompt, ProcessedPrompt):  # processed already (off the event loop)
            return prompt
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            ids = self.tokenizer.encode(text)
        else:
            raise TypeError(
                "a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}; got "
                f"{type(prompt).__name__}"
            )
        mm_inputs = None
        if mm_data:
            ids, mm_inputs = self.process_multimodal(ids, mm_data)
        self.validate(ids)
        return ProcessedPrompt(text, ids, mm_inputs)

    def process_multimodal(
        self, ids: list[int], mm_data: Any
    ) -> tuple[list[int], MultiModalInputs | None]:
        """The images of ``multi_modal_data`` checked against the limits and expanded into the
        prompt by the model's processor."""
        if not isinstance(mm_data, dict):
            raise TypeError("multi_modal_data is a dict: {'image': an image or a list of them}")
        proc = self.mm_processor
        if proc is None:
            raise ValueError(
                f"model {self.info.name!r} ({self.info.shape.architecture}) takes text only;"
                " it cannot read multi_modal_data (images)"
            )
        images: list[Any] = []
        for modality, items in mm_data.items():
            if modality not in proc.modalities:
                raise ValueError(
                    f"multi_modal_data: modality {modality!r} is not supported by this model"
                    f" (it takes {', '.join(proc.modalities)})"
                )
            items = items if isinstance(items, list) else [items]
            limit = self.mm_limits.get(modality, 0)
            if len(items) > limit:
                raise ValueError(
                    f"the prompt has {len(items)} {modality}s, more than limit_mm_per_prompt"
                    f"[{modality!r}]={limit}"
                )
            images += [load_image(item, self.media_limits) for item in items]
        if not images:
            return ids, None
        return proc.process(ids, images)

    def process_pooling(
        self, prompt: PromptType | tuple[str, str], truncate: int | None = None
    ) -> ProcessedPrompt:
        """A pooling request's prompt: a prompt as ``process`` takes it, or a pair of texts (a
        cross-encoder's query and document, tokenized as a pair). ``truncate``
        (``truncate_prompt_tokens``): keep at most that many tokens (-1: ``max_model_len``); a
        text is truncated by its tokenizer (its special tokens kept), token ids keep their last.
        The prompt may fill the whole context (no output token follows)."""
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            raise ValueError("pooling requests take text only; multi_modal_data is for generation")
        limit = self.info.max_model_len
        k = limit if truncate == -1 else truncate
        kwargs = {} if k is None else {"truncation": True, "max_length": k}
        types: list[int] | None = None
        if isinstance(prompt, tuple):
            if len(prompt) != 2 or not all(isinstance(p, str) for p in prompt):
                raise TypeError("a pair to score is two strings (query, document)")
            enc = self.tokenizer(prompt[0], prompt[1], **kwargs)
            text, ids = None, list(enc["input_ids"])
            types = list(enc.get("token_type_ids") or []) or None
        elif isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt" in prompt
                                         and "prompt_token_ids" not in prompt):  # fmt: skip
            text = prompt if isinstance(prompt, str) else prompt["prompt"]
            ids = list(self.tokenizer(text, **kwargs)["input_ids"])
        else:
            processed = self.process_ids(prompt)
            text, ids = processed.prompt, processed.prompt_token_ids
            if k is not None:
                ids = ids[-k:]
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        self._check_ids(ids)
        if len(ids) > limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the model's context is {limit} "
                "(max_model_len); truncate_prompt_tokens asks to truncate it"
            )
        # BERT's segments (``token_type_ids``) ride in the ids' high bits to the model.
        segments = getattr(self.info.shape.config, "type_vocab_size", 1) > 1
        if types is not None and any(types) and segments:
            ids = encode_token_types(ids, types)
        return ProcessedPrompt(text, ids)

    def process_ids(self, prompt: PromptType) -> ProcessedPrompt:
        if not (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            raise TypeError(
                "a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}; got "
                f"{type(prompt).__name__}"
            )
        ids = prompt["prompt_token_ids"]
        # NOTE: a list is taken as given (the engine never changes a prompt's ids): a copy is a
        # new object the collector walks, 512 references a prompt, at the call's end.
        return ProcessedPrompt(prompt.get("prompt"), ids if type(ids) is list else list(ids))

    def _check_ids(self, ids: list[int]) -> None:
        _check_token_ids(ids, self.info.shape.vocab_size)

    def validate(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        _check_token_ids(ids, self.info.shape.vocab_size)
        limit = self.info.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the model's context is {limit} "
                "(max_model_len), which must also leave room for one output token"
            )


def _check_token_ids(ids: list[int], vocab: int) -> None:
    """Raise naming the first bad ids unless every id is an integer in ``[0, vocab)``."""
    # NOTE: C loops (types, bounds) first: a Python loop over the ids cost ~80 us a 512-token
    # prompt, most of the host time before an embedding batch's first step.
    if not ids or (set(map(type, ids)) <= _INT_TYPES and min(ids) >= 0 and max(ids) < vocab):
        return
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")


_INT_TYPES = {int, bool}
