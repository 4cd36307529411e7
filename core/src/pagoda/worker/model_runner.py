"""The model runner: turns a scheduler output into one forward pass and sampled tokens.

The flat batch (token ids, positions, slot mapping, block tables, query start offsets, sequence
lengths) is written into buffers allocated once at the largest step size, so a GPU runner can
replay CUDA graphs over the same memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from pagoda.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagoda.attention.layer import Attention, set_forward_context
from pagoda.attention.selector import select_attention_backend
from pagoda.config import EngineConfig
from pagoda.loader import ModelArchConfig, init_dummy_, iter_safetensors
from pagoda.plugins import get_registry
from pagoda.plugins.seams import build_logits_processors
from pagoda.sample.metadata import LogprobsTensors
from pagoda.sample.ops import gather_logprobs
from pagoda.sample.sampler import Sampler
from pagoda.scheduler.output import ModelRunnerOutput, PromptLogprobs, SchedulerOutput
from pagoda.utils import cdiv
from pagoda.worker.cuda_graph import DecodeGraphs
from pagoda.worker.input_batch import InputBatch

_CPU_KV_CACHE_BYTES = 4 << 30
_PROMPT_LOGPROBS_CHUNK = 256  # prompt positions whose full-vocabulary logits exist at once


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArchConfig,
        hf_dir: str,
        load_format: str,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.config = config
        self.arch = arch
        self.hf_dir = hf_dir
        self.load_format = load_format
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_tokens = max_num_batched_tokens
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.block_size = config.cache.block_size
        self.max_blocks_per_req = cdiv(max_model_len, self.block_size)
        self.attn_backend: type[AttentionBackend] = select_attention_backend(
            config.attention.backend, device, dtype, arch.head_dim, self.block_size
        )
        self.sampler = Sampler()
        # Plugin seam: plugins' logits processors, built once; the sampler runs them each step.
        self.sampler.logits_processors += build_logits_processors(config, arch.vocab_size, device)
        self.input_batch = InputBatch(
            self.max_num_reqs, max_model_len + 1, self.max_blocks_per_req, arch.vocab_size, device
        )
        self._alloc_buffers()
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []

    def _alloc_buffers(self) -> None:
        d, n, r = self.device, self.max_num_tokens, self.max_num_reqs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=d)
        self.positions = torch.zeros(n, dtype=torch.int64, device=d)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=d)
        self.query_start_loc = torch.zeros(r + 1, dtype=torch.int32, device=d)
        self.seq_lens = torch.zeros(r, dtype=torch.int32, device=d)
        self.block_table = torch.zeros(r, self.max_blocks_per_req, dtype=torch.int32, device=d)
        self.logits_indices = torch.zeros(r, dtype=torch.int64, device=d)
        self._arange = np.arange(max(n, r) + 1, dtype=np.int64)

    # ---- loading -------------------------------------------------------------------------------

    def load_model(self) -> None:
        model_cls = get_registry("models").get(self.arch.architecture)
        with _default_dtype(self.dtype), torch.device(self.device):
            model = model_cls(self.arch, self.attn_backend)
        if self.load_format == "dummy":
            init_dummy_(model, self.config.model.seed)
        else:
            model.load_weights(iter_safetensors(self.hf_dir))
        self.model = model.eval()

    def kv_cache_block_bytes(self) -> int:
        a = self.arch
        elems = 2 * self.block_size * a.num_key_value_heads * a.head_dim
        return elems * a.num_hidden_layers * self.dtype.itemsize

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            activations = self.max_num_tokens * self.arch.hidden_size * 4 * 16 + (
                self.max_num_reqs * self.arch.vocab_size * 4 * 4
            )
            budget = int(total * cache.gpu_memory_utilization) - (total - free) - activations
        else:
            # NOTE: no more than every running request could fill at once, so small models on a
            # CPU do not zero gigabytes they never use.
            useful = self.max_num_reqs * self.max_blocks_per_req + 1
            budget = min(_CPU_KV_CACHE_BYTES, useful * self.kv_cache_block_bytes())
        num_blocks = budget // self.kv_cache_block_bytes()
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no block of "
                f"{self.kv_cache_block_bytes()} bytes; raise cache.kv_cache_memory_bytes or "
                "cache.gpu_memory_utilization, or lower max_model_len"
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        a = self.arch
        shape = self.attn_backend.get_kv_cache_shape(
            num_blocks, self.block_size, a.num_key_value_heads, a.head_dim
        )
        # Zeroed: padded slots are read under a mask, and 0 * NaN would poison the output.
        self.kv_caches = []
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
                self.kv_caches.append(module.kv_cache)
        self.decode_graphs: DecodeGraphs | None = None
        self.graph_capture_s = 0.0
        if (
            self.device.type == "cuda"
            and not self.config.model.enforce_eager
            and self.attn_backend.supports_cuda_graph
        ):
            self.decode_graphs = DecodeGraphs(self)
            self.graph_capture_s = self.decode_graphs.capture()

    # ---- one step ------------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> tuple[list[str], np.ndarray]:
        ib = self.input_batch
        for req_id in so.finished_req_ids:
            ib.remove(req_id)
        req_ids: list[str] = []
        computed: list[int] = []
        for new in so.scheduled_new_reqs:
            ib.remove(new.req_id)  # a resumed request may still hold its old row
            ib.add(new)
            req_ids.append(new.req_id)
            computed.append(new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            ib.append_blocks(ib.row_of[cached.req_id], cached.new_block_ids)
            req_ids.append(cached.req_id)
            computed.append(cached.num_computed_tokens)
        return req_ids, np.asarray(computed, dtype=np.int64)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        req_ids, starts = self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [])
        ib = self.input_batch
        rows = np.fromiter((ib.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        counts = np.fromiter(
            (so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids)
        )
        num_reqs, total = len(req_ids), int(counts.sum())
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        tok_req = np.repeat(self._arange[:num_reqs], counts)
        positions = np.repeat(starts - qsl[:-1], counts) + self._arange[:total]
        seq_lens = starts + counts

        token_rows = rows[tok_req]
        input_ids = ib.token_ids[token_rows, positions]
        max_blocks = cdiv(int(seq_lens.max()), self.block_size)
        block_table = ib.block_table[rows, :max_blocks]
        bs = self.block_size
        slots = block_table[tok_req, positions // bs].astype(np.int64) * bs + positions % bs

        self.input_ids[:total].copy_(torch.from_numpy(input_ids), non_blocking=True)
        self.positions[:total].copy_(torch.from_numpy(positions), non_blocking=True)
        self.slot_mapping[:total].copy_(torch.from_numpy(slots), non_blocking=True)
        self.query_start_loc[: num_reqs + 1].copy_(torch.from_numpy(qsl), non_blocking=True)
        self.seq_lens[:num_reqs].copy_(torch.from_numpy(seq_lens), non_blocking=True)
        self.block_table[:num_reqs, :max_blocks].copy_(
            torch.from_numpy(block_table), non_blocking=True
        )
        common = CommonAttentionMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=total,
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_table=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:total],
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )

        # Requests whose known tokens are all computed after this step sample one more.
        sampling = seq_lens >= ib.num_tokens[rows]
        sample_idx = np.nonzero(sampling)[0]
        num_sampling = len(sample_idx)

        graphs = self.decode_graphs
        bucket = graphs.bucket_for(num_reqs) if graphs and total == num_reqs else None
        if bucket is not None:
            hidden = graphs.run(num_reqs, bucket)
        else:
            with set_forward_context(self.attn_backend.build_metadata(common)):
                hidden = self.model(self.input_ids[:total], self.positions[:total])
        out = ModelRunnerOutput(req_ids, [[] for _ in req_ids])
        if num_sampling:
            self._sample(hidden, out, rows, sample_idx, qsl)
        self._prompt_logprobs(hidden, out, rows, starts, counts, qsl)
        return out

    # ---- sampling and logprobs -----------------------------------------------------------------

    def _sample(
        self,
        hidden: torch.Tensor,
        out: ModelRunnerOutput,
        rows: np.ndarray,
        sample_idx: np.ndarray,
        qsl: np.ndarray,
    ) -> None:
        """Sample the next token of the requests ``sample_idx`` (indices into the step's requests)
        from the hidden state of their last scheduled token."""
        ib = self.input_batch
        n = len(sample_idx)
        self.logits_indices[:n].copy_(torch.from_numpy(qsl[1:][sample_idx] - 1))
        logits = self.model.compute_logits(hidden[self.logits_indices[:n]])
        sample_rows = rows[sample_idx]
        md = ib.sampling_metadata(sample_rows)
        if self.sampler.logits_processors:
            md.req_ids = [out.req_ids[i] for i in sample_idx]
        result = self.sampler(logits, md)
        tokens = ib.append_sampled(sample_rows, result.sampled)
        for i, t in zip(sample_idx.tolist(), tokens.tolist()):
            out.sampled_token_ids[i] = [t]
        if result.logprobs is not None:
            arrays = result.logprobs.to_arrays()
            ks = ib.sampling.logprobs[sample_rows]
            for j in np.nonzero(ks >= 0)[0].tolist():
                out.logprobs[out.req_ids[sample_idx[j]]] = arrays.select(j, j + 1, int(ks[j]))

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        out: ModelRunnerOutput,
        rows: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        qsl: np.ndarray,
    ) -> None:
        """Logprobs of the prompt tokens that this step's tokens predict, for the requests that
        asked for ``prompt_logprobs`` (one chunk at a time under chunked prefill)."""
        ib = self.input_batch
        ks = ib.sampling.prompt_logprobs[rows]
        # Position p predicts prompt token p + 1; the last prompt position predicts output.
        ends = np.minimum(starts + counts, ib.num_prompt[rows] - 1)
        want = np.nonzero((ks >= 0) & (ends > starts))[0]
        if not len(want):
            return
        n_pos = ends[want] - starts[want]
        first = np.cumsum(n_pos) - n_pos
        local = self._arange[: int(n_pos.sum())] - np.repeat(first, n_pos)
        positions = np.repeat(starts[want], n_pos) + local
        hidden_idx = torch.from_numpy(np.repeat(qsl[want], n_pos) + local).to(self.device)
        targets = ib.token_ids[np.repeat(rows[want], n_pos), positions + 1]
        targets_t = torch.from_numpy(targets).to(self.device)
        k = int(ks[want].max())
        parts = []
        for s in range(0, len(targets), _PROMPT_LOGPROBS_CHUNK):
            idx = slice(s, s + _PROMPT_LOGPROBS_CHUNK)
            logits = self.model.compute_logits(hidden[hidden_idx[idx]])
            parts.append(gather_logprobs(logits.log_softmax(dim=-1), k, targets_t[idx]))
        arrays = LogprobsTensors.cat(parts).to_arrays()
        for j, i in enumerate(want.tolist()):
            chunk = arrays.select(int(first[j]), int(first[j] + n_pos[j]), int(ks[i]))
            out.prompt_logprobs[out.req_ids[i]] = PromptLogprobs(int(starts[i]), chunk)
