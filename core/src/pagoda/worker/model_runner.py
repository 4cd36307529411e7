"""The model runner: turns a scheduler output into one forward pass and sampled tokens.

The flat batch (token ids, positions, slot mapping, block tables, query start offsets, sequence
lengths) is written into buffers allocated once at the largest step size (``StepBuffers``), so a
GPU runner can replay CUDA graphs over the same memory. Speculative decoding's side of a step
(proposing, filling draft slots, verifying) works on the runner's ``Speculation``, not on the
runner.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from pagoda.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagoda.attention.batch_invariant import invariant_attention_backend
from pagoda.attention.layer import Attention, set_forward_context
from pagoda.attention.selector import select_attention_backend
from pagoda.config import EngineConfig
from pagoda.distributed import (
    get_pp_size,
    get_tp_size,
    is_first_stage,
    is_last_stage,
    recv_from_prev_stage,
    send_to_next_stage,
    stage_layers,
)
from pagoda.kv_offload.medium import OffloadMedium, build_offload_medium
from pagoda.loader import init_dummy_, iter_safetensors
from pagoda.loader.construct import build_model
from pagoda.loader.sharded import iter_safetensors_slices
from pagoda.models.shape import ModelShape
from pagoda.ops import batch_invariant, set_fused_ops
from pagoda.plugins import get_registry
from pagoda.plugins.seams import build_logits_processors
from pagoda.pooling.config import PoolerConfig
from pagoda.quantization import QuantizationMethod, finish_loading, is_fp8, kv_cache_dtype
from pagoda.sample.metadata import LogprobsTensors
from pagoda.sample.ops import gather_logprobs
from pagoda.sample.sampler import Sampler
from pagoda.spec_decode.proposer import ProposerContext, TargetModel, build_proposer
from pagoda.step import ModelRunnerOutput, SchedulerOutput
from pagoda.structured_output.runner import grammar_rows
from pagoda.utils import cdiv
from pagoda.worker.cuda_graph import DecodeGraphs
from pagoda.worker.draft_slots import fill_draft_slots, must_read_last, propose_for_slots
from pagoda.worker.drafts_ahead import check_ahead, launch_ahead, plan_ahead, take_drafts
from pagoda.worker.encoder_runner import EncoderRunner
from pagoda.worker.greedy_verify_graphs import GreedyVerifyGraphs
from pagoda.worker.hidden_states import HiddenFeed
from pagoda.worker.host_memory import available_memory_bytes, lazily_zeroed
from pagoda.worker.input_batch import InputBatch
from pagoda.worker.late_drafts import LateDrafts
from pagoda.worker.lora_inputs import LoRAInputs
from pagoda.worker.piecewise_graphs import PiecewiseGraphs
from pagoda.worker.pooling import PoolingRunner
from pagoda.worker.profile import check_gpu_share, gpu_kv_budget, profile_peak_activations
from pagoda.worker.spec_propose import propose_after
from pagoda.worker.spec_verify import run_verify_graph, verify_drafts
from pagoda.worker.speculation import Speculation
from pagoda.worker.step_buffers import StepBuffers
from pagoda.worker.step_inputs_kernel import warm as warm_step_inputs_kernel
from pagoda.worker.step_output import PromptLogprobsPart, StepOutput
from pagoda.worker.steps_in_flight import StepsInFlight
from pagoda.worker.verify_inputs_kernel import warm as warm_verify_inputs_kernel
from pagoda.worker.warm_steps import logits_rows, warm_context_steps, warm_logits_rows

logger = logging.getLogger(__name__)

_PROMPT_LOGPROBS_CHUNK = 256  # prompt positions whose full-vocabulary logits exist at once


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        shape: ModelShape,
        hf_dir: str,
        load_format: str,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        max_num_batched_tokens: int,
        *,
        model_impl: str = "native",
        pooler: PoolerConfig | None = None,
        quantization: QuantizationMethod | None = None,
    ) -> None:
        self.config = config
        # The quantization method the model's linears take (None: full precision), and the KV
        # cache's dtype (``cache.kv_cache_dtype``).
        self.quantization = quantization
        self.kv_cache_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, dtype)
        # Pooling requests' poolers and their state across prompt chunks (None: the model only
        # generates); built once the model is loaded.
        self.pooler = pooler
        self.pooling: PoolingRunner | None = None
        self.shape = shape
        self.model_impl = model_impl  # the registered model impl that builds the model
        self.hf_dir = hf_dir
        self.load_format = load_format
        self.device = device
        # The device's free memory before this engine takes any: its share
        # (cache.gpu_memory_utilization) is counted from here, whatever others hold.
        self.gpu_free_at_start = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_tokens = max_num_batched_tokens
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.block_size = config.cache.block_size
        self.max_blocks_per_req = cdiv(max_model_len, self.block_size)
        # Batch-invariant mode (model.batch_invariant) brings its own attention.
        self.batch_invariant = config.model.batch_invariant
        # The module class load_model builds; its layers' attention specs (the shape's) steer
        # the backend's selection.
        self.model_cls = get_registry("model_impls").get(model_impl).model_class(shape)
        head_size = max(shape.head_sizes)
        if self.batch_invariant and self.kv_cache_dtype != dtype:
            raise ValueError(
                "model.batch_invariant runs its own attention, which reads no KV cache of "
                f"cache.kv_cache_dtype={config.cache.kv_cache_dtype}; use kv_cache_dtype auto"
            )
        self.attn_backend: type[AttentionBackend] = (
            invariant_attention_backend(config, device, dtype, head_size)
            if self.batch_invariant
            else select_attention_backend(
                config.attention.backend,
                device,
                dtype,
                head_size,
                self.block_size,
                shape.attention,
                self.kv_cache_dtype,
            )
        )
        self.attn_backend.configure(config.attention)
        # Pipeline parallelism: this stage's decoder layers; only the first stage embeds token
        # ids, only the last samples (the others hand their output on).
        self.pipeline = get_pp_size() > 1
        self.stage = stage_layers(shape.num_hidden_layers)
        self.first_stage, self.last_stage = is_first_stage(), is_last_stage()
        self.stage_attention = shape.attention[self.stage[0] : self.stage[1]]
        # Each layer's cache: this tensor-parallel rank's KV heads of the layer's head size (of
        # this stage's layers).
        self.kv_layouts = [(s.num_kv_heads, s.cache_head_size) for s in self.stage_attention]
        self.sampler = Sampler()
        # Speculative decoding: the proposer named by ``speculative.method`` (None: off).
        self.proposer = build_proposer(
            ProposerContext(
                config.speculative,
                shape.vocab_size,
                shape.hidden_size,
                self.max_num_reqs,
                max_model_len,
                device,
                dtype,
            )
        )
        # Plugin seam: plugins' logits processors, built once; the sampler runs them each step.
        self.sampler.logits_processors += build_logits_processors(config, shape.vocab_size, device)
        self.input_batch = InputBatch(
            self.max_num_reqs, max_model_len + 1, self.max_blocks_per_req, shape.vocab_size, device
        )
        # Structured output: the constrained requests' matchers and each step's bitmask.
        self.grammar = grammar_rows(config, shape.vocab_size, self.max_num_reqs, device)
        self.buffers = StepBuffers.allocate(
            device, self.max_num_tokens, self.max_num_reqs, self.max_blocks_per_req, self.block_size
        )
        self.in_flight = StepsInFlight(self.max_num_reqs, device)
        # Speculative decoding's state between steps (None: off). With async scheduling a
        # proposer that reads only history proposes in ``launch``, for the requests with draft
        # slots, from the last step launched; others after each step.
        self.spec: Speculation | None = None
        if self.proposer is not None:
            self.spec = Speculation(
                self.proposer,
                config.speculative.max_num_drafts,
                shape.vocab_size,
                max_model_len,
                self.input_batch,
                self.buffers,
                self.in_flight,
                self.sampler,
                self.grammar,
                propose_in_launch=(
                    config.scheduler.async_scheduling and not self.proposer.needs_hidden_states
                ),
            )
        self.model: torch.nn.Module | None = None
        # LoRA (lora.enable_lora): the adapter slots and each step's slot inputs (None: off).
        self.lora: LoRAInputs | None = None
        # A multimodal model's images and encoder outputs (None: the model takes text only).
        self.encoder: EncoderRunner | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_offload: OffloadMedium | None = None  # KV offload's pool and copies
        # Seconds spent in each start-up phase: load_weights_s, profile_s, kv_cache_s,
        # graph_capture_s (those that ran).
        self.startup_times: dict[str, float] = {}
        self.memory_profile: dict[str, int] = {}

    # ---- loading -------------------------------------------------------------------------------

    def load_model(self) -> None:
        start = time.perf_counter()
        # NOTE: process-wide, read at each call: set before any graph is captured.
        set_fused_ops(self.config.model.fused_ops)
        batch_invariant.set_batch_invariant(self.batch_invariant)
        model_cls = self.model_cls
        args: tuple = (self.shape.config, self.attn_backend)
        if self.quantization is not None:
            if not getattr(model_cls, "supports_quantization", False):
                raise ValueError(
                    f"{model_cls.__name__} takes no quantization method (model.quantization="
                    f"{self.quantization.name}): its class does not declare "
                    "supports_quantization"
                )
            args += (self.quantization,)
        # Parameters are allocated, not initialised: the weights (or dummy values) fill them next.
        model = build_model(model_cls, *args, device=self.device, dtype=self.dtype)
        built = [m.spec for m in model.modules() if isinstance(m, Attention)]
        if built != list(self.stage_attention):
            raise ValueError(
                f"{model_cls.__name__} built {len(built)} attention layers whose specs differ "
                f"from the {len(self.stage_attention)} its model impl declared "
                f"({self.model_impl!r}, layers {self.stage[0]} to {self.stage[1]}): the KV "
                "cache is laid out from the declared ones"
            )
        if self.load_format == "dummy":
            init_dummy_(model, self.config.model.seed)
        else:
            # NOTE: a tensor-parallel rank reads its slices of the files, not whole tensors.
            read = iter_safetensors_slices if get_tp_size() > 1 else iter_safetensors
            model.load_weights(read(self.hf_dir))
        if self.quantization is not None:
            finish_loading(model)
        self.model = model.eval()
        if self.config.lora.enable_lora:  # (after loading: it wraps the loaded linears)
            self.lora = LoRAInputs(
                self.config.lora, self.model, self.shape.config, self.buffers, self.device
            )
        if self.pooler is not None:
            bidirectional = not any(spec.causal for spec in self.stage_attention)
            self.pooling = PoolingRunner(self.model, self.pooler, bidirectional)
        if hasattr(self.model, "embed_multimodal"):
            self.encoder = EncoderRunner(self.model, self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.startup_times["load_weights_s"] = time.perf_counter() - start

    def kv_cache_block_bytes(self) -> int:
        per_token = self.shape.kv_bytes_per_token(self.kv_cache_dtype.itemsize, self.stage)
        extra = self.proposer.kv_cache_block_bytes(self.block_size) if self.proposer else 0
        return self.block_size * per_token + extra

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._gpu_kv_budget()
        else:
            budget = self._cpu_kv_budget()
        num_blocks = budget // self.kv_cache_block_bytes()
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no block of "
                f"{self.kv_cache_block_bytes()} bytes; raise cache.kv_cache_memory_bytes or "
                "cache.gpu_memory_utilization, or lower max_model_len"
            )
        return int(num_blocks)

    def _cpu_kv_budget(self) -> int:
        """No more than every running request can fill at once (``max_num_seqs`` requests of
        ``max_model_len`` tokens, plus block 0), and at most ``cache.cpu_kv_cache_fraction`` of
        the memory available now."""
        useful = (self.max_num_reqs * self.max_blocks_per_req + 1) * self.kv_cache_block_bytes()
        fraction = self.config.cache.cpu_kv_cache_fraction
        available = available_memory_bytes()
        budget = min(useful, int(available * fraction))
        logger.info(
            "KV cache: %.2f GiB (%d requests of %d tokens need %.2f GiB; limit %.2f of %.2f GiB "
            "available); memory is committed as the cache fills",
            budget / 2**30,
            self.max_num_reqs,
            self.max_model_len,
            useful / 2**30,
            fraction,
            available / 2**30,
        )
        return budget

    def _gpu_kv_budget(self) -> int:
        """What this engine's share of the GPU (``cache.gpu_memory_utilization`` of it, vLLM's
        meaning) leaves for the KV cache once what the engine took since it started (weights,
        CUDA context, libraries' workspaces) and the activations of the largest step (measured)
        are counted; memory others held before it started is not (``gpu_kv_budget``)."""
        start = time.perf_counter()
        activations = profile_peak_activations(
            self.model,
            self.attn_backend,
            self.buffers,
            self.kv_layouts,
            self.dtype,
            self.max_model_len,
        )
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # Decode graphs keep their own pool: activations of up to max_num_reqs tokens.
        graphs = 0
        if not self.config.model.enforce_eager and self.attn_backend.supports_cuda_graph:
            graphs = activations * min(1.0, self.max_num_reqs / self.max_num_tokens)
            # Piecewise graphs keep theirs: activations of up to their limit's tokens.
            graphs += activations * self._piecewise_limit() / self.max_num_tokens
            if self.proposer is not None and self.config.parallel.tensor_parallel_size == 1:
                graphs += GreedyVerifyGraphs.reserve_bytes(self.shape.vocab_size, self.dtype)
        utilization = self.config.cache.gpu_memory_utilization
        check_gpu_share(utilization, total, self.gpu_free_at_start)
        budget = gpu_kv_budget(
            utilization, total, self.gpu_free_at_start, free, activations, int(graphs)
        )
        self.startup_times["profile_s"] = time.perf_counter() - start
        self.memory_profile = {
            "total_bytes": total,
            "used_before_kv_bytes": total - free,
            "peak_activation_bytes": activations,
            "graph_reserve_bytes": int(graphs),
            "kv_cache_bytes": max(budget, 0),
        }
        logger.info(
            "GPU memory: %.2f GiB in use after loading, %.2f GiB peak activations, "
            "%.2f GiB for the KV cache (gpu_memory_utilization=%.2f)",
            (total - free) / 2**30,
            activations / 2**30,
            max(budget, 0) / 2**30,
            self.config.cache.gpu_memory_utilization,
        )
        return budget

    def initialize_kv_cache(self, num_blocks: int) -> None:
        start = time.perf_counter()
        # NOTE: zeroed, because backends read never-written slots under a mask (the tail of a
        # request's last block, block 0 in padded rows) and 0 * NaN would poison the output. On
        # a CPU the zeros are the OS's fresh pages: no fill pass, memory committed as written.
        # On a GPU every layer's cache is a slice of one tensor, so that KV offload moves a
        # block of every layer with one kernel (pagoda.kv_offload.cpu.stack_layers).
        # Layers of one layout share a stacked tensor (a model whose layers all match has one).
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        shapes = [
            self.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, heads, size)
            for heads, size in self.kv_layouts
        ]
        if self.device.type == "cpu":
            self.kv_caches = [lazily_zeroed(shape, self.kv_cache_dtype) for shape in shapes]
        else:
            self.kv_caches = [torch.empty(0)] * len(layers)
            for shape in dict.fromkeys(shapes):
                idx = [i for i, s in enumerate(shapes) if s == shape]
                stacked = torch.zeros(
                    (len(idx), *shape), dtype=self.kv_cache_dtype, device=self.device
                )
                for i, cache in zip(idx, stacked.unbind(0)):
                    self.kv_caches[i] = cache
        for module, cache in zip(layers, self.kv_caches):
            module.kv_cache = cache
        self.kv_offload = build_offload_medium(
            self.config.cache,
            self.shape,
            self.kv_caches,
            self.attn_backend.get_kv_cache_shape,
        )
        self.startup_times["kv_cache_s"] = time.perf_counter() - start
        spec = self.spec
        if spec is not None:  # a draft model loads here, before graphs are captured
            self._bind_proposer(spec, num_blocks)
        self.decode_graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.graph_capture_s = 0.0
        self.logits_rows_warmed = 0  # (row counts the LM head was warmed for: 1 to this)
        if (
            self.device.type == "cuda"
            and not self.config.model.enforce_eager
            and self.attn_backend.supports_cuda_graph
            and not getattr(self.model, "pooling_only", False)  # it never decodes
            # NOTE: a pipeline stage runs eagerly: a later stage's input is the previous
            # stage's hidden states, which the decode graphs do not take.
            and not self.pipeline
        ):
            self.decode_graphs = self._graphs()
            if self.lora is not None:  # captured with the LoRA path, the slots as inputs
                self.lora.context.batch = self.lora.graph_batch
            self.graph_capture_s = self.decode_graphs.capture()
            if self.lora is not None:
                self.lora.context.batch = None
            if spec is not None:
                # Speculative verification steps (k + 1 tokens a request) as graphs too, and
                # all-greedy verifications of small batches: their sampling as graphs too.
                spec.verify_graphs = self._graphs(query_len=spec.num_spec_tokens + 1)
                self.graph_capture_s += spec.verify_graphs.capture()
                if self.config.parallel.tensor_parallel_size == 1:
                    spec.greedy_graphs = GreedyVerifyGraphs(
                        self.model, self.buffers.input_ids, spec.verify_graphs
                    )
                    self.graph_capture_s += spec.greedy_graphs.capture()
                    if LateDrafts.fits(
                        spec.proposer,
                        self.device,
                        asked_in_launch=spec.propose_in_launch,
                        drafts_after_verify=spec.drafts_after_verify,
                        replans=spec.verify_graphs.replans,
                    ):
                        spec.late = LateDrafts(
                            spec.verify_graphs.max_batch, spec.num_spec_tokens, self.device
                        )
            self.piecewise = self._piecewise_graphs()
            if self.piecewise is not None:
                self.graph_capture_s += self.piecewise.capture()
                if not self.piecewise.sizes:
                    self.piecewise = None
            self.startup_times["graph_capture_s"] = self.graph_capture_s
        if (
            self.device.type == "cuda"
            and not self.pipeline
            and all(layer.spec.causal for layer in layers)  # (encoders get no cached context)
        ):
            # Steps over a cached context, so that the attention kernels they select compile
            # now, not in a request's step (pagoda.worker.warm_steps). Before the FP8 scales'
            # calibration is armed below: these steps must not set them.
            _, self.startup_times["warm_steps_s"] = warm_context_steps(
                self.model, self.attn_backend, self.buffers, self.max_model_len, num_blocks
            )
        if is_fp8(self.kv_cache_dtype) and self.config.cache.calculate_kv_scales:
            # NOTE: after the graphs' capture (its dummy steps would set them): the first prompt
            # sets each layer's scales, which the graphs read from the layer's buffers.
            for layer in layers:
                layer.calibrate_kv_scales = not layer.kv_scales_loaded
        if (
            self.device.type == "cuda"
            and not self.pipeline
            and not self.batch_invariant  # (its own GEMM kernels, compiled once a shape class)
            and not getattr(self.model, "pooling_only", False)
        ):
            # Each row count a step may score outside a graph, once (pagoda.worker.warm_steps):
            # the first product of a count stalls the host for milliseconds.
            k = 0 if spec is None else spec.num_spec_tokens
            rows = logits_rows(self.max_num_reqs, self.max_num_tokens, k)
            self.logits_rows_warmed, self.startup_times["warm_logits_s"] = warm_logits_rows(
                self.model.compute_logits,
                self.shape.hidden_size,
                self.shape.vocab_size,
                rows,
                self.dtype,
                self.device,
            )
            logger.debug(
                "LM head warmed for 1 to %d of up to %d rows a step", self.logits_rows_warmed, rows
            )
        # The kernel that copies each step's inputs compiles here, not in the first step.
        warm_step_inputs_kernel(self.device)
        if self.device.type == "cuda" and spec is not None:
            # The greedy verification kernel compiles here, not in the first step that verifies.
            # NOTE: imported here: it imports Triton, a heavy optional dependency that only CUDA
            # engines with speculation need.
            from pagoda.sample import greedy_verify_kernel

            greedy_verify_kernel.warm(self.device, spec.num_spec_tokens)
            if spec.verify_graphs is not None and spec.drafts_after_verify:
                warm_verify_inputs_kernel(self.device, spec.num_spec_tokens)

    def _piecewise_limit(self) -> int:
        """The most tokens of a step that piecewise graphs replay (0: none are captured): not
        in batch-invariant mode (its own kernels, not captured), nor with LoRA adapters (a
        step's slots are host data the eager path reads)."""
        if self.batch_invariant or self.lora is not None:
            return 0
        return min(self.config.model.piecewise_graph_max_tokens, self.max_num_tokens)

    def _piecewise_graphs(self) -> PiecewiseGraphs | None:
        """Steps with prompt tokens as graphs between attention calls
        (``pagoda.worker.piecewise_graphs``), where the limit allows any."""
        limit = self._piecewise_limit()
        return PiecewiseGraphs(self.model, self.buffers, limit) if limit > 0 else None

    def _graphs(self, query_len: int = 1) -> DecodeGraphs:
        """CUDA graphs of steps of ``query_len`` tokens a request over the step buffers."""
        return DecodeGraphs(
            self.model, self.attn_backend, self.buffers, self.max_model_len, query_len
        )

    def _bind_proposer(self, spec: Speculation, num_blocks: int) -> None:
        """Hand the proposer the target (``bind_target``), and keep the hidden states it asked
        for."""
        ib = self.input_batch
        target = TargetModel(
            model=self.model,
            num_hidden_layers=self.shape.num_hidden_layers,
            attn_backend=self.attn_backend,
            num_blocks=num_blocks,
            block_size=self.block_size,
            block_table=ib.block_table,
            num_row_blocks=ib.num_blocks,
        )
        spec.model = self.model
        spec.proposer.bind_target(target)
        if spec.needs_hidden_states:
            spec.hidden_feed = HiddenFeed(
                spec.proposer,
                self.model,
                self.buffers,
                ib.row_of,
                self.max_model_len,
                self.shape.hidden_size,
                self.dtype,
            )

    # ---- one step ------------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> tuple[list[str], np.ndarray]:
        ib = self.input_batch
        for req_id in so.finished_req_ids:
            ib.remove(req_id)
            self.grammar.remove(req_id)
            if self.lora is not None:
                self.lora.remove(req_id)
        if self.spec is not None:
            self.spec.forget(so.finished_req_ids)
        if self.pooling is not None:
            self.pooling.forget(so.finished_req_ids)
        if self.encoder is not None:
            self.encoder.forget(so.finished_req_ids)
        req_ids: list[str] = []
        computed: list[int] = []
        for new in so.scheduled_new_reqs:
            ib.remove(new.req_id)  # a resumed request may still hold its old row
            self.in_flight.forget_row(ib.add(new))
            if self.lora is not None:
                self.lora.add(new.req_id, new.lora_request)
            if self.encoder is not None:
                self.encoder.add(new.req_id, new.mm_inputs)
            self.grammar.add(new.req_id, new.sampling_params.structured_outputs)
            if new.pooling_params is not None:
                if self.pooling is None:
                    raise ValueError(f"request {new.req_id!r}: this model serves no pooling")
                self.pooling.add(new.req_id, new.pooling_params)
            req_ids.append(new.req_id)
            computed.append(new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            ib.append_blocks(ib.row_of[cached.req_id], cached.new_block_ids, cached.block_offset)
            if cached.new_token_ids and not self.last_stage:  # (the last stage sampled them)
                ib.write_outputs(cached.req_id, cached.num_computed_tokens, cached.new_token_ids)
            req_ids.append(cached.req_id)
            computed.append(cached.num_computed_tokens)
        return req_ids, np.asarray(computed, dtype=np.int64)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its output."""
        return self.launch(so).get()

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> StepOutput:
        """Launch one step; its output comes from ``get()`` on what this returns.

        The tokens sampled by the previous step may still be on the device (their rows hold -1):
        they reach this step's input ids there, without a host round trip.
        """
        scheduled = so.scheduled_spec_decode_tokens
        spec, in_flight, buffers = self.spec, self.in_flight, self.buffers
        if spec is not None:
            spec.verify_rows = None  # (set by this launch's padded verification graph)
            spec.proposer.settle()  # (before anything reads its pauses)
            if spec.late is not None:
                spec.late.check()
        if in_flight.unread and in_flight.unread[-1].pending is not None:
            in_flight.unread[-1].finish_launch()  # its sampling waited for its grammar bitmask
        ahead = None
        if scheduled and spec is not None and (spec.drafts_after_verify or spec.late is not None):
            # The verification graph replays behind the step in flight, which is read next
            # (``pagoda.worker.drafts_ahead``); a history proposer's drafts follow from the host
            # once it is read (``pagoda.worker.late_drafts``).
            plan = plan_ahead(spec, so)
            if plan is not None:
                in_flight.settle()  # every step before the one in flight is read (not it)
                buffers.next_launch()
                req_ids, starts = self._update_states(so)  # cached requests: their new blocks
                ahead = launch_ahead(spec, plan, req_ids, starts)
        launched_at = time.perf_counter() if spec is not None else 0.0  # (``SlotCost``)
        waits = ahead is not None or bool(
            in_flight.unread and must_read_last(spec, in_flight.unread[-1], so)
        )
        try:
            if waits:
                # NOTE: rows with drafts learn their length only there, and draft slots are
                # filled with the drafts proposed there.
                in_flight.read_all()
            if scheduled and spec is not None and spec.propose_in_launch:
                propose_for_slots(spec, scheduled)
        finally:
            if ahead is not None and ahead.drafts is None:  # the device waits for these
                spec.late.release(ahead.req_ids, spec.proposals)
        in_flight.settle()
        if ahead is not None:  # (its launch took the staging region and the new blocks)
            req_ids, starts = ahead.req_ids, ahead.starts
            take_drafts(spec, ahead)
        else:
            buffers.next_launch()
            if so.kv_transfers is not None and self.kv_offload is not None:
                self.kv_offload.submit(so.kv_transfers)  # before the forward, which may wait
            req_ids, starts = self._update_states(so)
        ib = self.input_batch
        if so.total_num_scheduled_tokens == 0:
            return StepOutput(ib, [], kv_offload=self.kv_offload)
        rows = np.fromiter((ib.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        counts = np.fromiter(
            (so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids)
        )
        drafts, filled = {}, {}
        if spec is not None:
            # NOTE: a request whose last step had drafts was scheduled as if all were accepted;
            # it goes on from its last known token.
            np.minimum(starts, ib.num_tokens[rows] - 1, out=starts)
        if scheduled:
            drafts, filled = fill_draft_slots(spec, scheduled, req_ids, counts)
            ib.write_drafts(drafts)
        if in_flight.unread and ib.sampling.needs_token_history(rows):
            in_flight.unread.pop().get()  # bad words read the ids on the host: wait for them
        num_reqs, total = len(req_ids), int(counts.sum())
        if spec is not None:
            # Decode steps only, with slots left empty or none (``pagoda.worker.slot_cost``).
            decode = not drafts and not so.scheduled_new_reqs and total == num_reqs
            spec.slot_cost.launched(num_reqs, waits if decode else None, launched_at)
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        tok_req = np.repeat(buffers.arange[:num_reqs], counts)
        positions = np.repeat(starts - qsl[:-1], counts) + buffers.arange[:total]
        seq_lens = starts + counts

        verify_graphs = None if spec is None else spec.verify_graphs
        check = spec is not None and spec.check_ahead
        verified = late_rows = None
        if ahead is not None and (counts == verify_graphs.query_len).all():
            verified = ahead.hidden  # these inputs, built on the device, replayed already
        elif ahead is not None and ahead.drafts is None:
            # Late drafts, fewer than k for some request: its own rows come first in its q
            # (the rest scored filler, never compared, as in a padded verification).
            q = verify_graphs.query_len
            late_rows = np.repeat(buffers.arange[:num_reqs] * q - qsl[:-1], counts)
            late_rows += buffers.arange[:total]
            spec.verify_rows = ahead.hidden
            verified = ahead.hidden[buffers.as_device(late_rows)]
        if verified is None or check:
            token_rows = rows[tok_req]
            # (gathers through flat indices: half the time of two-dimensional fancy indexing,
            # 0.3 ms against 0.7 for a step of 32,768 tokens on a CPU core)
            width = ib.token_ids.shape[1]
            input_ids = np.take(ib.token_ids.reshape(-1), token_rows * width + positions)
            max_blocks = cdiv(int(seq_lens.max()), self.block_size)
            block_table = ib.block_table[rows, :max_blocks]
            bs = self.block_size
            block = positions // bs
            slots = np.take(block_table.reshape(-1), tok_req * max_blocks + block).astype(np.int64)
            slots = slots * bs + (positions - block * bs)
            unknown = np.flatnonzero(input_ids < 0)
        graphs = self.decode_graphs
        mm = None
        if self.encoder is not None:  # images: encoded first, their rows and positions
            self.encoder.run(so)
            mm = self.encoder.step_inputs(req_ids, starts, counts, qsl, positions)
        eager = mm is not None and mm.eager
        plain = graphs and total == num_reqs and not eager and verified is None
        bucket = graphs.bucket_for(num_reqs) if plain else None
        if verified is not None:
            if check:
                check_ahead(spec, input_ids, positions, slots, seq_lens, late_rows)
        elif bucket is None and verify_graphs is not None:
            # NOTE: a verification graph copies its own (padded) inputs: none are copied here.
            step = (counts, starts, qsl, input_ids, positions, slots, rows)
            verified = run_verify_graph(spec, *step, unknown, token_rows[unknown])
        if verified is None:
            pos = positions if mm is None else mm.positions
            buffers.copy_inputs(input_ids, pos, slots, qsl, seq_lens, block_table)
            if len(unknown):  # (after the ids' copy: these overwrite their placeholders)
                in_flight.fill_from_device(buffers, unknown, token_rows[unknown])
            common = CommonAttentionMetadata(
                num_reqs=num_reqs,
                num_actual_tokens=total,
                max_query_len=int(counts.max()),
                max_seq_len=int(seq_lens.max()),
                query_start_loc=buffers.query_start_loc[: num_reqs + 1],
                seq_lens=buffers.seq_lens[:num_reqs],
                block_table=buffers.block_table[:num_reqs],
                slot_mapping=buffers.slot_mapping[:total],
                query_start_loc_cpu=qsl,
                seq_lens_cpu=seq_lens,
                block_size=bs,
            )
        if self.lora is not None:
            graph_tokens = None if bucket is None else bucket * graphs.query_len
            self.lora.prepare(req_ids, counts, qsl, graph_tokens)
        # An embedding step that reads one row a request (the last token; an encoder's first)
        # runs the last layer for those rows alone (``keeps_rows``): their queries attend, and
        # only they go on past attention.
        keep = pooled = None
        if self.pooling is not None:
            # The step's pooling requests, and which of them end their prompt here.
            pooled = ib.pooling[rows]
            num_prompt = ib.num_prompt[rows]
            prompt_done = seq_lens >= num_prompt
        if (
            pooled is not None
            and bucket is None
            and verified is None
            and spec is None
            and self.lora is None
            and mm is None
            and not self.pipeline
            and getattr(self.model, "keeps_rows", False)
            and pooled.all()
        ):
            keep = self.pooling.kept_rows(req_ids, qsl, prompt_done, starts)
        if bucket is not None:
            hidden = graphs.run(common, bucket)
        elif verified is not None:
            hidden = verified
        elif self.pipeline:
            with set_forward_context(self.attn_backend.build_metadata(common)):
                hidden = self._stage_forward(total)
            if not self.last_stage:  # the next stage goes on from here; nothing samples here
                send_to_next_stage(hidden)
                out = StepOutput(ib, req_ids, kv_offload=self.kv_offload)
                in_flight.launched(out)
                return out
        else:
            metadata = self.attn_backend.build_metadata(common)
            rows_read, kept = {}, None
            if keep is not None:
                # (the last layer's kept rows attend as a step of one query a request)
                rows_read["keep"] = buffers.as_device(keep)
                qsl_kept = buffers.as_device(buffers.arange[: num_reqs + 1].astype(np.int32))
                kept = self.attn_backend.build_metadata(
                    common.kept_rows(rows_read["keep"], qsl_kept)
                )
            # (a step whose keys and values no later step reads: layers that attend over the
            # step's own skip storing them; see ``Attention.stores_kv``)
            pw = self.piecewise
            size = None if pw is None or eager or keep is not None else pw.size_for(total)
            with set_forward_context(metadata, common.slot_mapping, kept, so.kv_unread):
                if eager:
                    pos = buffers.positions[:total] if mm.positions_3d is None else mm.positions_3d
                    hidden = self.model(buffers.input_ids[:total], pos, mm_embeds=mm.embeds)
                elif size is not None:
                    hidden = pw.run(total, size)
                else:
                    hidden = self.model(
                        buffers.input_ids[:total], buffers.positions[:total], **rows_read
                    )

        out = StepOutput(ib, req_ids, kv_offload=self.kv_offload)
        if self.lora is not None and self.lora.failed:
            out.failed = self.lora.take_failures()
        # Requests whose known tokens are all computed after this step sample one more.
        sample_idx = np.flatnonzero(seq_lens >= ib.num_tokens[rows])
        # Pooling requests are pooled, never sampled: a step of only those samples nothing.
        if pooled is not None and pooled.any():
            out.pooled = self.pooling.pool(
                hidden,
                req_ids,
                np.flatnonzero(pooled),
                qsl if keep is None else np.arange(num_reqs + 1),  # (kept: a row each)
                prompt_done,
                num_prompt,
                buffers.as_device,
            )
            sample_idx = sample_idx[~pooled[sample_idx]]
        if spec is not None and spec.hidden_feed is not None:
            q = verify_graphs.query_len if verified is not None else None
            spec.hidden_feed.record(out, hidden, req_ids, starts, qsl, sample_idx, q)
        out.draft_counts = filled
        if len(sample_idx) and drafts:
            # Like _sample, with drafts: the rejection sampler keeps each request's accepted
            # drafts and adds one token.
            verify_drafts(spec, hidden, out, rows, sample_idx, qsl, drafts)
        elif len(sample_idx):
            self._sample(hidden, out, rows, sample_idx, qsl)
        if spec is not None and (not spec.propose_in_launch or so.alternate_drafts):
            # NOTE: with drafting off (the governor) the proposer is not asked: its drafts would
            # not be scheduled; one that reads hidden states has them kept for its next call. A
            # step that alternates (``SchedulerOutput.alternate_drafts``) proposes here even
            # where slots are filled at launch.
            if so.propose_drafts or spec.needs_hidden_states:
                out.on_output = self._propose if so.propose_drafts else self._hold_hidden
        self._prompt_logprobs(hidden, out, rows, starts, counts, qsl)
        if out.pending is None:
            self._end_launch(out, bool(drafts))
        in_flight.launched(out)
        if spec is not None:
            # The proposer's bookkeeping of drafts proposed in this launch, now that the device
            # runs the step they are for (``SpeculativeProposer.settle``); not part of what
            # this step's slots cost (``SlotCost.exclude``).
            began = time.perf_counter()
            spec.proposer.settle()
            spec.slot_cost.exclude(time.perf_counter() - began)
        return out

    def _stage_forward(self, total: int) -> torch.Tensor:
        """This pipeline stage's forward pass over the step's ``total`` tokens: the first
        stage's from the token ids, a later one's from the previous stage's output."""
        ids, positions = self.buffers.input_ids[:total], self.buffers.positions[:total]
        if self.first_stage:
            return self.model(ids, positions)
        shape = (2, total, self.shape.hidden_size)
        return self.model(ids, positions, recv_from_prev_stage(shape, self.dtype, self.device))

    def _end_launch(self, out: StepOutput, drafted: bool) -> None:
        """The end of a step's launch, once its sampling is launched: the event its output
        waits for, and (structured output) the next bitmask, filled while the host moves on."""
        if self.device.type == "cuda":
            out.event = torch.cuda.Event()
            out.event.record()
        if self.grammar.entries and out.sampled is not None and not drafted:
            self.grammar.after_launch(out, self.device)

    # ---- sampling and logprobs -----------------------------------------------------------------

    def _sample(
        self,
        hidden: torch.Tensor,
        out: StepOutput,
        rows: np.ndarray,
        sample_idx: np.ndarray,
        qsl: np.ndarray,
    ) -> None:
        """Sample the next token of the requests ``sample_idx`` (indices into the step's requests)
        from the hidden state of their last scheduled token."""
        ib = self.input_batch
        n = len(sample_idx)
        li = self.buffers.logits_indices[:n]
        self.buffers.to_device(li, qsl[1:][sample_idx] - 1)
        logits = self.model.compute_logits(hidden[li])
        sample_rows = rows[sample_idx]
        md = ib.sampling_metadata(sample_rows)
        if self.sampler.logits_processors:
            md.req_ids = [out.req_ids[i] for i in sample_idx]
        out.sample_idx = sample_idx
        out.sample_rows = sample_rows
        if self.spec is not None and self.spec.needs_hidden_states:
            out.proposer_hidden = hidden[li]
        constrained = self.grammar.entries and any(
            out.req_ids[i] in self.grammar.entries for i in sample_idx.tolist()
        )
        if not constrained:
            out.sample_pos = ib.append_placeholders(sample_rows)
            self._sample_logits(logits, md, out)
            return
        # Structured output: the bitmask needs the previous step's tokens, which the grammar
        # thread is advancing the matchers over. Sampling waits for it, not the host: it is
        # launched at the start of the next launch (or by ``get``), while the forward pass runs;
        # meanwhile the engine reads the last output and schedules (vLLM's split of a step into
        # execute and sample).
        num_tokens = ib.num_tokens.copy()  # before this step's placeholders
        out.sample_pos = ib.append_placeholders(sample_rows)

        @torch.inference_mode()  # NOTE: it may run from ``get``, outside ``launch``
        def sample() -> None:
            md.grammar = self.grammar.mask(
                [out.req_ids[i] for i in sample_idx],
                sample_rows,
                ib.token_ids,
                num_tokens,
                ib.num_prompt,
                lambda: [s.get() for s in self.in_flight.unread if s is not out],
                self.device,
            )
            self._sample_logits(logits, md, out)
            self.grammar.after_sample(out, self.in_flight.sampled)

        if self.proposer is not None:  # NOTE: a proposer reads this step's sample at once
            sample()
        else:
            out.pending = lambda: (sample(), self._end_launch(out, drafted=False))

    def _sample_logits(self, logits: torch.Tensor, md: Any, out: StepOutput) -> None:
        """Sample the processed logits of ``out``'s sampling rows; the sampled ids become the
        next step's input on the device and are copied to the host behind the step."""
        ib = self.input_batch
        sample_rows = out.sample_rows
        result = self.sampler(logits, md)
        ib.sampling.record_sampled(sample_rows, result.sampled)
        self.in_flight.drew(sample_rows, result.sampled)
        out.sampled = result.sampled.to("cpu", non_blocking=True)
        if result.logprobs is not None:
            out.logprobs = result.logprobs.to_host()
            out.logprobs_ks = ib.sampling.logprobs[sample_rows]

    def _propose(self, step: StepOutput, output: ModelRunnerOutput) -> None:
        """Once a step's output is on the host: the proposer's drafts for the next step."""
        propose_after(self.spec, step, output)

    def _hold_hidden(self, step: StepOutput, output: ModelRunnerOutput) -> None:
        """Drafting is off (the governor): the proposer is not asked, its hidden states wait."""
        propose_after(self.spec, step, output, draft=False)

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        out: StepOutput,
        rows: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        qsl: np.ndarray,
    ) -> None:
        """Logprobs of the prompt tokens that this step's tokens predict, for the requests that
        asked for ``prompt_logprobs`` (one chunk at a time under chunked prefill)."""
        ib = self.input_batch
        ks = ib.sampling.prompt_logprobs[rows]
        if ks.max() < 0:  # (most steps: nobody asked)
            return
        # Position p predicts prompt token p + 1; the last prompt position predicts output.
        ends = np.minimum(starts + counts, ib.num_prompt[rows] - 1)
        want = np.nonzero((ks >= 0) & (ends > starts))[0]
        if not len(want):
            return
        n_pos = ends[want] - starts[want]
        first = np.cumsum(n_pos) - n_pos
        local = self.buffers.arange[: int(n_pos.sum())] - np.repeat(first, n_pos)
        positions = np.repeat(starts[want], n_pos) + local
        hidden_idx = self.buffers.as_device(np.repeat(qsl[want], n_pos) + local)
        targets = ib.token_ids[np.repeat(rows[want], n_pos), positions + 1]
        targets_t = self.buffers.as_device(targets)
        k = int(ks[want].max())
        parts = []
        for s in range(0, len(targets), _PROMPT_LOGPROBS_CHUNK):
            idx = slice(s, s + _PROMPT_LOGPROBS_CHUNK)
            logits = self.model.compute_logits(hidden[hidden_idx[idx]])
            if self.batch_invariant:
                lps = batch_invariant.log_softmax(logits)
            else:
                lps = logits.float().log_softmax(dim=-1)
            parts.append(gather_logprobs(lps, k, targets_t[idx]))
        out.prompt_logprobs = PromptLogprobsPart(
            LogprobsTensors.cat(parts).to_host(), want, first, n_pos, starts, ks
        )
