"""The synchronous engine: input processing, the engine core, output processing."""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine.core import EngineCore
from pagoda.engine.dp_client import SyncDPClient, check_device_ranks
from pagoda.engine.input_processor import InputProcessor, PromptType
from pagoda.engine.output_processor import OutputProcessor
from pagoda.lora.peft import WEIGHTS_FILE, check_adapter
from pagoda.lora_request import LoRARequest
from pagoda.model_info import ModelInfo, load_model_tokenizer, model_eos_ids
from pagoda.multimodal import MediaLimits
from pagoda.multimodal.model import build_mm_processor
from pagoda.multimodal_inputs import MultiModalInputs
from pagoda.outputs import PoolingRequestOutput, RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.manager import validate_structured_outputs

# A pooling request's sampling parameters: one object for all of them (never sampled, never
# changed once a request is submitted).
_POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


class LLMEngine:
    """Input processing, an engine core and output processing.

    ``engine_core`` is the core itself (in this process; the default) or a client of one in
    another process (``AsyncLLM`` passes its ``AsyncMPClient``; ``step`` is then not used).
    With ``parallel.data_parallel_size`` above 1 the default is a ``SyncDPClient``: that many
    cores, each in its own process.
    """

    def __init__(self, config: EngineConfig, engine_core: Any = None) -> None:
        self.config = config
        self.info = ModelInfo.from_config(config)
        # The last PoolingParams resolve_pooling returned: given back, it is returned as is.
        self._last_resolved: PoolingParams | None = None
        self.tokenizer = load_model_tokenizer(self.info, config.model.trust_remote_code)
        self.eos_token_id: int | None = self.tokenizer.eos_token_id
        # Other ids that end a turn (generation_config.json, config.json) stop like EOS.
        self.extra_eos_ids = model_eos_ids(self.info) - {self.eos_token_id}
        # A vision-language model's processor runs here, in the front end (None: text only).
        mc = config.model
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.info,
            build_mm_processor(self.info, self.tokenizer),
            dict(mc.limit_mm_per_prompt),
            MediaLimits(mc.max_image_pixels, mc.max_image_bytes),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        if engine_core is None:
            check_device_ranks(config, self.info)
            if config.parallel.data_parallel_size > 1:
                engine_core = SyncDPClient(config, self.info)
            else:
                engine_core = EngineCore(config, self.info)
        self.engine_core = engine_core
        self._ids = itertools.count()
        self._loras: dict[int, LoRARequest] = {}  # adapters checked, by id

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        final_only: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Submit a request; ``final_only``: ``step`` returns its output once, when it finishes
        (none before); ``lora_request``: the adapter it runs with (None: the base model)."""
        processed = self.input_processor.process(prompt)
        self.add_processed(
            request_id,
            processed.prompt,
            processed.prompt_token_ids,
            params,
            priority,
            final_only,
            lora_request=lora_request,
        )

    def add_processed(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        final_only: bool = False,
        lora_request: LoRARequest | None = None,
        mm_inputs: MultiModalInputs | None = None,
    ) -> None:
        """Submit a processed prompt (``mm_inputs``: its images, processed)."""
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already running")
        if "generate" not in self.info.tasks:
            raise ValueError(
                f"model {self.info.name!r} ({self.info.shape.architecture}) serves "
                f"{', '.join(self.info.tasks)}, not generation: it has no LM head to sample from "
                "(ask for embeddings, classification or scores instead)"
            )
        self._check_logprobs(params)
        if lora_request is not None:
            self.check_lora(lora_request)
        if params.structured_outputs is not None:  # a bad schema, regex or grammar: refused here
            validate_structured_outputs(self.config, params.structured_outputs)
        eos_ids = self.extra_eos_ids | ({self.eos_token_id} - {None})
        vocab = self.info.shape.vocab_size
        seqs = []
        for i in range(params.n):
            child = (
                params
                if params.n == 1
                else dataclasses.replace(
                    params,
                    n=1,
                    seed=None if params.seed is None else params.seed + i,
                    # The prompt is the same for every sample: the first computes its logprobs.
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                )
            )
            child = child.resolve(self.tokenizer, vocab, eos_ids)
            seqs.append((request_id if params.n == 1 else f"{i}_{request_id}", child))
        try:
            self.output_processor.add_request(
                request_id, prompt, prompt_token_ids, seqs, final_only
            )
            for i, (seq_id, child) in enumerate(seqs):
                self.engine_core.add_request(
                    Request(
                        request_id=seq_id,
                        prompt_token_ids=prompt_token_ids,
                        sampling_params=child,
                        eos_token_id=self.eos_token_id,
                        priority=priority,
                        # Samples after the first wait for its prompt's blocks (prefilled once).
                        prefill_leader=seqs[0][0] if i else None,
                        lora_request=lora_request,
                        mm_inputs=mm_inputs,
                    )
                )
        except BaseException:
            # Refused by the core (an admission rule, say) or the output processor: no part of
            # the request stays registered or sent.
            self.abort_request([request_id])
            raise

    def check_lora(self, lora: LoRARequest) -> None:
        """Refuse, in one line naming it, an adapter the engine cannot serve: LoRA off, an id
        that names another adapter, a missing or malformed PEFT folder, a rank above
        ``lora.max_lora_rank``, target modules the model lacks. Checked once per adapter."""
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if not self.config.lora.enable_lora:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r}: LoRA is off; start the engine with "
                "lora.enable_lora (--enable-lora, LLM(enable_lora=True))"
            )
        known = self._loras.get(lora.lora_int_id)
        if known == lora:
            if not os.path.isfile(os.path.join(lora.lora_path, WEIGHTS_FILE)):
                # NOTE: a worker may read it again (its host copies are a cache): refused here,
                # the request never reaches it.
                raise ValueError(
                    f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): no {WEIGHTS_FILE} "
                    "(gone since the adapter was first checked)"
                )
            return
        if known is not None:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r}: lora_int_id {lora.lora_int_id} is adapter "
                f"{known.lora_name!r} ({known.lora_path}); give each adapter its own id"
            )
        check_adapter(lora, self.info.shape.config, self.config.lora.max_lora_rank)
        self._loras[lora.lora_int_id] = lora

    def forget_lora(self, lora_int_id: int) -> None:
        """Forget a checked adapter (unloaded): its id may name another one next."""
        self._loras.pop(lora_int_id, None)

    def resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """``params`` checked against the model's pooling config and filled in; ``ValueError``
        naming the field when the model cannot serve it."""
        if params is self._last_resolved:  # (resolved here already: a batch's shared params)
            return params
        task = params.task or "embed"
        if self.info.pooler is None:
            raise ValueError(
                f"PoolingParams.task={task!r}: model {self.info.name!r} serves "
                f"{', '.join(self.info.tasks)} only (model.task / --task embed makes a model with "
                "an LM head serve embeddings too)"
            )
        self._last_resolved = self.info.pooler.resolve(params)
        return self._last_resolved

    def add_pooling(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: PoolingParams,
        priority: int = 0,
    ) -> None:
        """Submit a pooling request (its prompt processed by ``process_pooling``); its one
        output is a ``PoolingRequestOutput`` from ``step`` once its prompt is computed."""
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already running")
        resolved = self.resolve_pooling(params)
        self.output_processor.add_pooling(request_id, prompt, prompt_token_ids)
        try:
            self.engine_core.add_request(
                Request(
                    request_id=request_id,
                    prompt_token_ids=prompt_token_ids,
                    sampling_params=_POOLING_SAMPLING,
                    priority=priority,
                    pooling_params=resolved,
                )
            )
        except BaseException:
            self.abort_request([request_id])
            raise

    def _check_logprobs(self, params: SamplingParams) -> None:
        # NOTE: every position returns k entries to the host and through the output processor,
        # so an unbounded k would let one request stall the engine for everyone.
        limit = self.config.model.max_logprobs
        if limit < 0:
            return
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > limit:
                raise ValueError(
                    f"SamplingParams.{name}={k}: more than model.max_logprobs={limit} allows "
                    "(the engine's configuration sets it; -1 lifts the limit)"
                )

    def abort_request(self, request_ids: list[str]) -> None:
        seq_ids = []
        for rid in request_ids:
            seq_ids += self.output_processor.abort(rid)
        self.engine_core.abort_requests(seq_ids)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        core_outputs = self.engine_core.step()
        outputs, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        """The prompt text and token ids of a conversation, through the model's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer of {self.info.name!r} has no chat template; use generate()"
            )
        kwargs.setdefault("add_generation_prompt", True)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        # The template already holds the special tokens it wants.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}

    def shutdown(self) -> None:
        self.engine_core.shutdown()
