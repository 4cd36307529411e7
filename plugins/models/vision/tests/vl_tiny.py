"""A tiny random Qwen2.5-VL from transformers' own config classes (no downloads), saved as a
checkpoint folder with a stand-in tokenizer, and transformers' greedy generate as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers as tf
from PIL import Image

from pagoda.loader.synthetic import synthetic_tokenizer

IMAGE, START, END = 190, 188, 189
#: A chat template for the stand-in tokenizer: each message's text, then the prompt's turn.
TEMPLATE = "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}t5"


def tiny_config() -> Any:
    return tf.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END,
        video_token_id=191, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip


def hf_model(seed: int = 0) -> Any:
    cfg = tiny_config()
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = tf.Qwen2_5_VLForConditionalGeneration._from_config(
        cfg, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p[0].numel() ** -0.5)
    return model


def save(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder)
    tok = synthetic_tokenizer(200, 2)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return folder


def image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def prompt_ids(num_images: int, text: int = 5) -> list[int]:
    """Token ids: some text, then per image vision start, its placeholder, vision end, text."""
    ids = [10 + i for i in range(text)]
    for k in range(num_images):
        ids += [START, IMAGE, END] + [40 + k, 41 + k]
    return ids


def hf_generate(model: Any, ids: list[int], mm: Any, max_tokens: int):
    """transformers' greedy tokens and each step's log-probabilities, for the prompt ``ids``
    already expanded (``mm``: Pagoda's processed images, the same pixels)."""
    input_ids = torch.tensor([ids])
    kwargs = {}
    if mm is not None:
        kwargs["pixel_values"] = torch.from_numpy(
            np.concatenate([f.data["pixel_values"] for f in mm.features])
        )
        kwargs["image_grid_thw"] = torch.from_numpy(
            np.concatenate([f.data["image_grid_thw"] for f in mm.features])
        )
        kwargs["mm_token_type_ids"] = (input_ids == IMAGE).int()
    with torch.no_grad():
        out = model.generate(
            input_ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens,
            output_logits=True, return_dict_in_generate=True, **kwargs,
        )  # fmt: skip
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = torch.stack([lg[0].float().log_softmax(-1) for lg in out.logits])
    return tokens, logprobs
