"""``LLM``: offline batched generation, with vLLM's interface."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pagoda.config import EngineConfig
from pagoda.engine.input_processor import PromptType
from pagoda.engine.llm_engine import LLMEngine
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams


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

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts."""
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
        # Validate everything first, so a bad prompt leaves no half-submitted batch behind.
        processed = [self.engine.input_processor.process(p) for p in prompts]
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(processed, params)):
                rid = self.engine.new_request_id()
                prio = 0 if priority is None else priority[i]
                # ``_run`` reads only finished outputs: none is built before.
                self.engine.add_processed(
                    rid, p.prompt, p.prompt_token_ids, sp, prio, final_only=True
                )
                ids.append(rid)
        except BaseException:
            # A request the engine refused (an admission rule, say) takes the batch with it.
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm and len(ids) > 1)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.apply_chat_template(c, **template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], show_progress: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not show_progress)
        try:
            while len(finished) < len(request_ids):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine stopped with requests unfinished")
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self.engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]
