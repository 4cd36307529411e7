"""Train an EAGLE-3 head for a model from its own outputs, and write it in the public layout.

    pagoda-train-eagle3 --model MODEL --out HEAD_DIR [--num-prompts 512] [--max-tokens 256]

1. Prompts from text that ships with Python (standard-library docstrings and sources, under a
   few instructions, through the model's chat template); Pagoda generates greedy continuations
   and records, for every position, the hidden states entering EAGLE-3's low, middle and high
   layers and the final hidden state (the proposer contract's hidden-state feed: no second
   forward).
2. A draft vocabulary of the most frequent output tokens (``d2t``/``t2d``); the head's LM head
   starts from the target's rows for them (``--freeze-lm-head`` keeps it there).
3. Training with EAGLE-3's training-time test: step 0 reads the fused target features, step s
   the head's own output of step s - 1, attending to the real context and to its own earlier
   steps at the same position, as the chain does at inference. Loss per step (weight 0.8^s):
   cross-entropy against the target's distribution over the draft vocabulary (token loss) plus
   a smooth-L1 pull of the head's normed output towards the target's final hidden state
   (feature loss, EAGLE's). Output positions weigh 1, prompt positions ``--prompt-weight``
   (default 0: the target's predictions inside a prompt can be data too).
4. The head is written (config.json, model.safetensors: ``fc``, ``midlayer.*``, ``norm``,
   ``lm_head``, ``d2t``, ``t2d``) and Pagoda serves held-out prompts with it: the mean
   acceptance length and the acceptance per draft position are printed (and written as JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from pagoda import LLM, SamplingParams
from pagoda.config import SpeculativeConfig
from pagoda.models.layers import RotaryEmbedding
from pagoda_spec_eagle.checkpoint import llama_head_config, write_head
from pagoda_spec_eagle.record import Recorded, corpus, generate_and_record


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Neox rotary embedding of x [B, heads, T, D] at positions [B, T]."""
    ang = pos[:, None, :, None].float() * inv_freq  # [B, 1, T, D/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class TrainHead(nn.Module):
    """The EAGLE-3 head in plain torch (autograd), parameters named as published."""

    def __init__(self, h: int, inter: int, nh: int, nkv: int, hd: int, dv: int, eps: float):
        super().__init__()
        self.h, self.nh, self.nkv, self.hd, self.eps = h, nh, nkv, hd, eps
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, dv, bias=False)
        for lin in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(lin.weight, std=0.02)
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, std=0.02)

    def qkv(self, emb: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, inv_freq):
        x = torch.cat([_rms(emb, self.input_layernorm, self.eps),
                       _rms(hidden, self.hidden_norm, self.eps)], dim=-1)  # fmt: skip
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        group = self.nh // self.nkv
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        return _rope(q, pos, inv_freq), _rope(k, pos, inv_freq), v

    def finish(self, attn: torch.Tensor, residual: torch.Tensor):
        b, _, t, _ = attn.shape
        x = self.o_proj(attn.transpose(1, 2).reshape(b, t, self.nh * self.hd))
        residual = x + residual
        x = _rms(residual, self.post_attention_layernorm, self.eps)
        x = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        summed = x + residual
        return summed, _rms(summed, self.norm, self.eps)

    def export(self, d2t: torch.Tensor, vocab: int) -> dict[str, torch.Tensor]:
        m = "midlayer."
        w = {
            "fc.weight": self.fc.weight,
            m + "self_attn.q_proj.weight": self.q_proj.weight,
            m + "self_attn.k_proj.weight": self.k_proj.weight,
            m + "self_attn.v_proj.weight": self.v_proj.weight,
            m + "self_attn.o_proj.weight": self.o_proj.weight,
            m + "mlp.gate_proj.weight": self.gate_proj.weight,
            m + "mlp.up_proj.weight": self.up_proj.weight,
            m + "mlp.down_proj.weight": self.down_proj.weight,
            m + "input_layernorm.weight": self.input_layernorm,
            m + "hidden_norm.weight": self.hidden_norm,
            m + "post_attention_layernorm.weight": self.post_attention_layernorm,
            "norm.weight": self.norm,
            "lm_head.weight": self.lm_head.weight,
            "d2t": d2t,
        }
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(len(d2t)) + d2t] = True
        w["t2d"] = t2d
        return {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
                for k, v in w.items()}  # fmt: skip


def ttt_forward(
    head: TrainHead,
    tokens: torch.Tensor,
    aux: torch.Tensor,
    valid: torch.Tensor,
    embed,
    inv_freq: torch.Tensor,
    steps: int,
):
    """EAGLE-3's training-time test over a padded batch, one step at a time: yields ``(s,
    normed)`` where ``normed[b, p]`` [B, T, H] is what the LM head reads at step ``s`` for the
    anchor position ``p``. Step 0 reads ``fc(aux[p])`` and token ``p + 1`` at position ``p``;
    step ``s`` reads step ``s - 1``'s output and token ``p + 1 + s`` at position ``p + s``,
    attending to step 0's keys at positions ``0..p`` and to its own earlier steps at the same
    anchor, as the drafting chain does at inference. Its prediction is the target's token at
    position ``p + s + 2``."""
    b, t = valid.shape
    dev = aux.device
    base = torch.arange(t, device=dev).expand(b, t)
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    mask0 = causal[None, None] & valid[:, None, None, :]
    hidden = head.fc(aux)
    scale = head.hd**-0.5
    ks, vs = [], []
    for s in range(steps):
        tok = torch.nn.functional.pad(tokens[:, 1 + s :], (0, s))[:, :t]
        q, k, v = head.qkv(embed(tok), hidden, base + s, inv_freq)
        if s == 0:
            k0, v0 = k, v
        else:
            ks.append(k)
            vs.append(v)
        scores = (q @ k0.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask0, float("-inf"))
        diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in ks]
        w = torch.cat([scores, *diag], dim=-1).float().softmax(dim=-1).to(q.dtype)
        attn = w[..., :t] @ v0
        for j, vj in enumerate(vs):
            attn = attn + w[..., t + j : t + j + 1] * vj
        hidden, normed = head.finish(attn, hidden)
        yield s, normed


def ttt_loss(
    head: TrainHead,
    batch: dict[str, torch.Tensor],
    embed: nn.Module,
    target_logits,
    inv_freq: torch.Tensor,
    steps: int,
    feature_weight: float,
) -> tuple[torch.Tensor, list[float]]:
    """The training-time test's loss (``ttt_forward``) over a padded batch: ``tokens`` [B, T +
    1], ``aux`` [B, T, 3H], ``final`` [B, T, H], ``valid`` [B, T] (a feature exists), ``learn``
    [B, T] float (how much the target's prediction at that position weighs: 1 for output tokens,
    less for prompt tokens, 0 for none). Returns the loss and each step's top-1 agreement with
    the target on output tokens."""
    final, valid, learn = batch["final"], batch["valid"], batch["learn"]
    b, t = valid.shape
    base = torch.arange(t, device=valid.device).expand(b, t)
    total = torch.zeros((), device=valid.device)
    agree = []
    forward = ttt_forward(head, batch["tokens"], batch["aux"], valid, embed, inv_freq, steps)
    for s, normed in forward:
        at = base + s + 1  # the target position whose prediction this step learns
        weight = learn.gather(1, at.clamp(max=t - 1))
        ok = (at < t) & (weight > 0) & valid.gather(1, at.clamp(max=t - 1))
        if not ok.any():
            break
        idx = at.clamp(max=t - 1)[ok]
        rows = ok.nonzero(as_tuple=True)[0]
        w = weight[ok]
        want_final = final[rows, idx]
        with torch.no_grad():
            p = target_logits(want_final).float().softmax(dim=-1)
        logits = head.lm_head(normed[ok]).float()
        token_loss = -(p * logits.log_softmax(dim=-1)).sum(-1)
        diff = F.smooth_l1_loss(normed[ok].float(), want_final.float(), reduction="none")
        per_row = token_loss + feature_weight * diff.mean(-1)
        total = total + (0.8**s) * (w * per_row).sum() / w.sum()
        output = w == 1
        hits = logits.argmax(-1) == p.argmax(-1)
        agree.append((hits[output].float().mean() if output.any() else hits.float().mean()).item())
    return total, agree


_TIMED_BATCHES = 16  # batches timed before a time budget resizes the learning-rate schedule


def _batches(data: list[Recorded], tokens_per_batch: int, gen: torch.Generator):
    order = sorted(range(len(data)), key=lambda i: len(data[i].tokens))
    groups, cur, longest = [], [], 0
    for i in order:
        n = len(data[i].tokens) - 1
        if cur and max(longest, n) * (len(cur) + 1) > tokens_per_batch:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        groups.append(cur)
    perm = torch.randperm(len(groups), generator=gen).tolist()
    return [groups[i] for i in perm]


def _collate(
    data: list[Recorded],
    ids: list[int],
    device: torch.device,
    dtype: torch.dtype,
    prompt_weight: float,
):
    t = max(len(data[i].tokens) - 1 for i in ids)
    b = len(ids)
    h3 = data[ids[0]].aux.shape[1]
    out = {  # built where the recorded rows are (the GPU's, on a GPU)
        "tokens": torch.zeros(b, t + 1, dtype=torch.int64),
        "aux": torch.zeros(b, t, h3, dtype=dtype, device=device),
        "final": torch.zeros(b, t, h3 // 3, dtype=dtype, device=device),
        "valid": torch.zeros(b, t, dtype=torch.bool),
        "learn": torch.zeros(b, t, dtype=torch.float32),
    }
    for j, i in enumerate(ids):
        r = data[i]
        n = len(r.tokens) - 1
        out["tokens"][j, : n + 1] = r.tokens
        out["aux"][j, :n] = r.aux.to(device, dtype)
        out["final"][j, :n] = r.final.to(device, dtype)
        out["valid"][j, :n] = True
        out["learn"][j, :n] = prompt_weight
        out["learn"][j, max(r.num_prompt - 1, 0) : n] = 1.0
    return {k: v.to(device, non_blocking=True) for k, v in out.items()}


def draft_vocabulary(data: list[Recorded], vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent output tokens (then the lowest ids), as target ids in
    increasing order; ``d2t`` is this minus ``arange(size)``."""
    size = min(size, vocab)
    counts = torch.zeros(vocab, dtype=torch.int64)
    for r in data:
        counts += torch.bincount(r.tokens[r.num_prompt :], minlength=vocab)[:vocab]
    order = torch.argsort(counts * vocab + (vocab - torch.arange(vocab)), descending=True)
    return torch.sort(order[:size]).values


def train_head(
    data: list[Recorded],
    target: Any,
    *,
    draft_vocab: int,
    epochs: int,
    steps: int,
    lr: float,
    tokens_per_batch: int,
    feature_weight: float,
    device: torch.device,
    seed: int,
    progress: bool = True,
    max_seconds: float | None = None,
    prompt_weight: float = 0.0,
    train_lm_head: bool = True,
    weight_decay: float = 0.0,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, float]]:
    """Fit a head on ``data``; returns its published weights, its config and training figures."""
    model = target.model
    cfg = model.config  # the target's ModelArchConfig
    h = cfg.hidden_size
    torch.manual_seed(seed)
    ids = draft_vocabulary(data, cfg.vocab_size, draft_vocab)
    dv = len(ids)
    head = TrainHead(
        h, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
        cfg.head_dim, dv, cfg.rms_norm_eps,
    ).to(device)  # fmt: skip
    dtype = torch.float32
    lm_w = model.lm_head.weight.detach().to(device, dtype)[ids.to(device)]
    with torch.no_grad():
        head.lm_head.weight.copy_(lm_w)
        head.norm.copy_(model.model.norm.weight.detach().to(device, dtype))
    emb_w = model.model.embed_tokens.weight.detach().to(device, dtype)

    def embed(tok: torch.Tensor) -> torch.Tensor:
        return F.embedding(tok, emb_w)

    def target_logits(x: torch.Tensor) -> torch.Tensor:
        return x.float() @ lm_w.T

    rope = RotaryEmbedding(cfg.head_dim, 8, cfg.rope_theta, cfg.rope_scaling)
    inv_freq = torch.atan2(rope.sin[1], rope.cos[1]).to(device)  # the angles at position 1
    gen = torch.Generator().manual_seed(seed)
    batches = [b for _ in range(epochs) for b in _batches(data, tokens_per_batch, gen)]
    head.lm_head.weight.requires_grad_(train_lm_head)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    planned = [len(batches)]  # cut to what fits max_seconds once batches are timed

    def schedule(i: int) -> float:
        total = planned[0]
        warm = max(1, total // 20)
        if i < warm:
            return (i + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (i - warm) / max(1, total - warm))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    start = time.perf_counter()
    done = 0
    bar = tqdm(batches, desc="training EAGLE-3 head", unit="batch", disable=not progress)
    recent: list[list[float]] = []
    for ids_b in bar:
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break  # out of time: the head so far
        done += 1
        batch = _collate(data, ids_b, device, dtype, prompt_weight)
        with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
            loss, agree = ttt_loss(
                head, batch, embed, target_logits, inv_freq, steps, feature_weight
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        sched.step()
        if max_seconds is not None and done == _TIMED_BATCHES:
            # NOTE: the learning rate decays to 0 by the time the budget runs out, not at a
            # last batch that the budget never reaches.
            per_batch = (time.perf_counter() - start) / done
            planned[0] = max(done + 1, min(len(batches), int(0.95 * max_seconds / per_batch)))
        recent = (recent + [agree])[-20:]
        if agree:
            bar.set_postfix(
                loss=f"{loss.item():.3f}", top1=f"{sum(r[0] for r in recent) / len(recent):.2f}"
            )
    seconds = time.perf_counter() - start
    d2t = ids - torch.arange(dv)
    bar.close()
    config = llama_head_config(
        "eagle3", h, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
        cfg.vocab_size, head_dim=cfg.head_dim, draft_vocab_size=dv, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        aux_layers=None,
    )  # fmt: skip
    if cfg.rope_scaling:
        config["rope_scaling"] = cfg.rope_scaling
    config["target_hidden_size"] = h
    per_step = [sum(r[s] for r in recent if len(r) > s) / max(1, sum(len(r) > s for r in recent))
                for s in range(steps)]  # fmt: skip
    figures = {
        "train_s": seconds,
        "batches": done,
        "batches_planned": len(batches),
        "batches_scheduled": planned[0],
        "top1_per_step_last": per_step,
    }
    return head.export(d2t, cfg.vocab_size), config, figures


def heldout_acceptance(
    engine_args: dict[str, Any], head_dir: str, prompts: list[list[int]], max_tokens: int, k: int
) -> dict[str, Any]:
    """Serve ``prompts`` greedily with the head: mean acceptance length (tokens per
    verification step, the target's own included) and acceptance per draft position."""
    spec = {"method": "eagle3", "model": head_dir, "num_speculative_tokens": k}
    if "adaptive" in SpeculativeConfig.model_fields:  # every step drafts: the head is measured
        spec["adaptive"] = False
    llm = LLM(**engine_args, speculative_config=spec)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    st = llm.engine.engine_core.scheduler.spec_stats_total
    per_pos = [a / st.num_drafts if st.num_drafts else 0.0 for a in st.accepted_per_pos]
    return {
        "num_speculative_tokens": k,
        "mean_acceptance_length": st.mean_acceptance_length,
        "acceptance_rate": st.acceptance_rate,
        "acceptance_per_position": per_pos,
        "num_drafts": st.num_drafts,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pagoda-train-eagle3",
        description="Train an EAGLE-3 draft head for a model from its own greedy outputs on "
        "prompts built from Python's standard-library documentation; writes the head in the "
        "public EAGLE-3 layout and reports its held-out acceptance.",
    )
    p.add_argument("--model", required=True, help="the target: a model folder or GGUF file")
    p.add_argument("--out", required=True, help="folder the head is written to")
    p.add_argument("--num-prompts", type=int, default=512, help="training prompts")
    p.add_argument(
        "--heldout-prompts",
        type=int,
        default=16,
        help="evaluation prompts (on texts not trained on)",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="tokens generated per prompt")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--ttt-steps", type=int, default=4, help="training-time-test steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tokens-per-batch", type=int, default=8192)
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size")
    p.add_argument("--feature-weight", type=float, default=0.1, help="weight of the feature loss")
    p.add_argument(
        "--prompt-weight",
        type=float,
        default=0.0,
        help="weight of the target's predictions inside prompts (output tokens weigh 1; "
        "default 0: outputs only)",
    )
    p.add_argument(
        "--freeze-lm-head",
        dest="train_lm_head",
        action="store_false",
        help="keep the draft LM head at the target's rows (default: trained from them)",
    )
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="k of the evaluation")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--engine-args", default="{}", help="more LLM(...) arguments, as JSON")
    p.add_argument("--max-train-s", type=float, default=None, help="stop training after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    engine_args = {"model": args.model, "device": device.type, "max_model_len": args.max_model_len}
    if device.type == "cuda":  # the recording and the evaluating engines share the GPU
        engine_args["kv_cache_memory_bytes"] = 4 << 30
    engine_args.update(json.loads(args.engine_args))
    progress = not args.no_progress
    messages = corpus(args.num_prompts, args.seed)
    messages += corpus(args.heldout_prompts, args.seed, heldout=True)
    t0 = time.perf_counter()
    data, target, heldout = generate_and_record(
        engine_args, messages, args.num_prompts, args.max_tokens, progress
    )
    gen_s = time.perf_counter() - t0
    n_tokens = sum(len(r.tokens) for r in data)
    n_out = sum(len(r.tokens) - r.num_prompt for r in data)
    print(f"recorded {len(data)} sequences, {n_tokens} tokens ({n_out} generated) in {gen_s:.1f} s")
    weights, config, figures = train_head(
        data, target, draft_vocab=args.draft_vocab, epochs=args.epochs, steps=args.ttt_steps,
        lr=args.lr, tokens_per_batch=args.tokens_per_batch, feature_weight=args.feature_weight,
        device=device, seed=args.seed, progress=progress, max_seconds=args.max_train_s,
        prompt_weight=args.prompt_weight, train_lm_head=args.train_lm_head,
        weight_decay=args.weight_decay,
    )  # fmt: skip
    del data, target
    gc.collect()
    write_head(args.out, config, weights)
    print(
        f"trained in {figures['train_s']:.1f} s ({figures['batches']} of "
        f"{figures['batches_planned']} batches); head: {args.out}"
    )
    report: dict[str, Any] = {
        "model": args.model,
        "device": device.type,
        "train_sequences": args.num_prompts,
        "train_tokens": n_tokens,
        "train_generated_tokens": n_out,
        "generate_record_s": gen_s,
        **figures,
        "draft_vocab_size": config["draft_vocab_size"],
        "epochs": args.epochs,
        "lr": args.lr,
        "prompt_weight": args.prompt_weight,
        "train_lm_head": args.train_lm_head,
        "weight_decay": args.weight_decay,
    }
    if args.json:  # now, and again with the held-out figures
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if heldout:
        acc = heldout_acceptance(
            engine_args, args.out, heldout, args.max_tokens, args.num_speculative_tokens
        )
        report["heldout"] = {"prompts": len(heldout), **acc}
        per = ", ".join(f"{a:.2f}" for a in acc["acceptance_per_position"])
        print(
            f"held-out ({len(heldout)} prompts, k={acc['num_speculative_tokens']}): mean "
            f"acceptance length {acc['mean_acceptance_length']:.2f}, acceptance per position "
            f"[{per}]"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
