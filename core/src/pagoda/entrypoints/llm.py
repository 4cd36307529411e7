"""``LLM``: offline batched generation, with vLLM's interface."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pagoda.config import EngineConfig
from pagoda.engine.admission import StepAdmission
from pagoda.engine.input_processor import PromptType
from pagoda.engine.llm_engine import LLMEngine
from pagoda.lora_request import LoRARequest
from pagoda.multimodal import MediaSource
from pagoda.multimodal.chat import load_chat_images, split_images
from pagoda.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagoda.pooling.ops import cosine, maxsim
from pagoda.pooling_params import PoolingParams
from pagoda.process import steps_gc
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.metrics import SpecDecodingStats


class LLM:
    """An engine in this process for offline generation.

    ``LLM(model=..., max_model_len=...)`` takes vLLM's argument names (each belongs to a config
    section: ``block_size`` to ``cache``, ``max_num_seqs`` to ``scheduler``, ...) or sections
    (``cache={"block_size": 32}``); ``LLM(config="engine.yaml")`` reads the file ``pagoda serve
    --config`` reads, or takes a built :class:`EngineConfig`. Explicit arguments override the
    file and the environment (``PAGODA_CACHE__BLOCK_SIZE=32``).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: str | Path | EngineConfig | None = None,
        **kwargs: Any,
    ) -> None:
        overrides = dict(kwargs)
        if model is not None:
            overrides["model"] = model
        if isinstance(config, EngineConfig):
            self.config = config.with_overrides(overrides) if overrides else config
        else:
            self.config = EngineConfig.load(config_file=config, overrides=overrides)
        self.engine = LLMEngine(self.config)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_metrics(self) -> dict[str, Any]:
        """This engine's counters since it started, under the names ``/metrics`` gives them
        (without the ``model_name`` label): speculative decoding's drafts, draft tokens,
        accepted tokens and accepted tokens per position (``SpecDecodingStats.as_metrics``);
        zeros without speculation."""
        return self.spec_decoding_stats().as_metrics()

    def spec_decoding_stats(self) -> SpecDecodingStats:
        """Drafts verified since the engine started (``summary()`` says it in one line)."""
        scheduler = getattr(self.engine.engine_core, "scheduler", None)
        total = getattr(scheduler, "spec_stats_total", None)
        return total if total is not None else SpecDecodingStats()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.
        ``lora_request``: the adapter of every prompt, or one per prompt (None: the base
        model)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one, "
                    "or one per prompt"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        for lora in dict.fromkeys(lr for lr in loras if lr is not None):
            self.engine.check_lora(lora)

        # NOTE: each prompt is processed (tokenized, checked) as it is added, a step's worth at a
        # time while the device runs the steps before; a bad one aborts the requests added
        # before it (``StepAdmission``), so the batch fails whole, as if checked first.
        def add(i: int, rid: str) -> int:
            p = self.engine.input_processor.process(prompts[i])
            # ``_run`` reads only finished outputs: none is built before.
            self.engine.add_processed(
                rid, p.prompt, p.prompt_token_ids, params[i],
                0 if priority is None else priority[i], final_only=True,
                lora_request=loras[i], mm_inputs=p.mm_inputs,
            )  # fmt: skip
            return len(p.prompt_token_ids)

        # NOTE: priorities order the waiting queue: all of them are in it from the start.
        admission = StepAdmission(self.engine, len(prompts), add, at_once=priority is not None)
        return self._run(admission.ids, use_tqdm and len(prompts) > 1, admission)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self._chat_prompt(c, template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _chat_prompt(
        self, conversation: list[dict[str, Any]], template_kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """A conversation's prompt; its image parts (``image_url``, ``image``) become the model's
        placeholders in the text and the prompt's ``multi_modal_data``."""
        proc = self.engine.input_processor.mm_processor
        image_text = "" if proc is None else proc.placeholder_text
        conversation, images = split_images(conversation, image_text)
        prompt = self.engine.apply_chat_template(conversation, **template_kwargs)
        if images:
            server, limits = self.config.server, self.engine.input_processor.media_limits
            source = MediaSource(server.allowed_local_media_path, server.allow_remote_media,
                                 server.media_fetch_timeout_s)  # fmt: skip
            prompt["multi_modal_data"] = {"image": load_chat_images(images, source, limits)}
        return prompt

    # ---- pooling ---------------------------------------------------------------------------------

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt (``pooling_task``, or each ``PoolingParams.task``; default
        ``embed``); outputs in the order of the prompts, each ``outputs.data`` a numpy array."""
        return self._encode(prompts, pooling_params, use_tqdm, pooling_task)

    def _encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        use_tqdm: bool,
        pooling_task: str | None,
        convert: Callable[[PoolingRequestOutput], Any] | None = None,
    ) -> list[Any]:
        """``encode``, each output passed through ``convert`` as its request finishes (while
        the device runs the steps after it), not all of them after the last step."""
        if isinstance(prompts, (str, dict, tuple)):
            prompts = [prompts]
        prompts = list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} PoolingParams for {len(prompts)} prompts; give one, "
                    "or one per prompt"
                )
        engine = self.engine

        def resolve(p: PoolingParams) -> PoolingParams:
            return engine.resolve_pooling(p if pooling_task is None else p.with_task(pooling_task))

        # The parameters are checked first (a wrong task or field fails before any step), each
        # object once (one given for every prompt is one); each prompt as it is added
        # (``generate`` says why).
        once = {key: resolve(p) for key, p in {id(p): p for p in params}.items()}
        resolved = [once[id(p)] for p in params]

        def add(i: int, rid: str) -> int:
            r = resolved[i]
            p = engine.input_processor.process_pooling(prompts[i], r.truncate_prompt_tokens)
            engine.add_pooling(rid, p.prompt, p.prompt_token_ids, r)
            return len(p.prompt_token_ids)

        admission = StepAdmission(engine, len(prompts), add)
        return self._run(admission.ids, use_tqdm and len(prompts) > 1, admission, convert)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``), pooled as the model's pooling
        config says; ``PoolingParams(dimensions=, normalize=)`` change it."""
        return self._encode(prompts, pooling_params, use_tqdm, "embed", _embedding_output)

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """The classification head's probabilities per prompt (``outputs.probs``; its logits
        with ``PoolingParams(activation=False)``)."""
        return self._encode(prompts, pooling_params, use_tqdm, "classify", _classification_output)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """The relevance of each ``data_2`` text to its ``data_1`` text (one ``data_1`` pairs
        with every ``data_2``): a cross-encoder's score where the model has one (task
        ``score``), else the cosine of the two embeddings, or late interaction's MaxSim of
        their token embeddings with ``PoolingParams(task="token_embed")``."""
        firsts = [data_1] if isinstance(data_1, str) else list(data_1)
        seconds = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds) or not seconds:
            raise ValueError(
                f"score: got {len(firsts)} first texts for {len(seconds)} second texts; give one "
                "first text, or one per second text (and at least one of each)"
            )
        params = pooling_params or PoolingParams()
        task = params.task
        if task is None:
            task = "score" if "score" in self.engine.info.tasks else "embed"
        if task == "score":
            pairs = list(zip(firsts, seconds))
            outs = self.encode(pairs, params, use_tqdm=use_tqdm, pooling_task="score")
            return [
                ScoringRequestOutput(
                    o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids
                )
                for o in outs
            ]
        if task not in ("embed", "token_embed"):
            raise ValueError(f"PoolingParams.task={task!r}: score takes score, embed, token_embed")
        texts = list(dict.fromkeys(firsts + seconds))
        outs = self.encode(texts, params, use_tqdm=use_tqdm, pooling_task=task)
        by_text = {t: o for t, o in zip(texts, outs)}
        sim = maxsim if task == "token_embed" else cosine
        results = []
        for a, b in zip(firsts, seconds):
            oa, ob = by_text[a], by_text[b]
            value = sim(_tensor(oa.outputs.data), _tensor(ob.outputs.data))
            ids = oa.prompt_token_ids + ob.prompt_token_ids
            results.append(ScoringRequestOutput(f"{oa.request_id}_{ob.request_id}",
                                                ScoringOutput(value), ids))  # fmt: skip
        return results

    def _run(
        self,
        request_ids: list[str],
        show_progress: bool,
        admission: StepAdmission | None = None,
        convert: Callable[[Any], Any] | None = None,
    ) -> list[Any]:
        """Step the engine until every request of ``request_ids`` has finished; ``admission``
        adds them as the steps need them (its ``ids``: all of them, added or not); ``convert``
        makes each final output what is returned, as it arrives."""
        finished: dict[str, Any] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not show_progress)
        try:
            with steps_gc():  # (the collector walks only what the call makes)
                while len(finished) < len(request_ids):
                    if admission is not None:
                        admission.top_up()
                    if not self.engine.has_unfinished_requests():
                        raise RuntimeError("the engine stopped with requests unfinished")
                    for out in self.engine.step():
                        if out.finished:
                            finished[out.request_id] = out if convert is None else convert(out)
                            bar.update(1)
        except BaseException:
            added = request_ids if admission is None else admission.added
            self.engine.abort_request([r for r in added if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


def _embedding_output(o: PoolingRequestOutput) -> EmbeddingRequestOutput:
    return EmbeddingRequestOutput(
        o.request_id, EmbeddingOutput(o.outputs.data), o.prompt_token_ids
    )


def _classification_output(o: PoolingRequestOutput) -> ClassificationRequestOutput:
    return ClassificationRequestOutput(
        o.request_id, ClassificationOutput(o.outputs.data.tolist()), o.prompt_token_ids
    )


def _tensor(data: Any) -> Any:
    # NOTE: torch is imported here: ``pagoda.entrypoints.llm`` loads with ``import pagoda``'s
    # lazy ``LLM``, and the engine brings torch in anyway.
    import torch

    return torch.from_numpy(data)
