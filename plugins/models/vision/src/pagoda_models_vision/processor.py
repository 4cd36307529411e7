"""Qwen2.5-VL's processor in the front end: transformers' image processor (resize to multiples of
28, normalise, patchify) and the prompt's M-RoPE positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pagoda.multimodal import MultiModalProcessor
from pagoda.multimodal_inputs import MultiModalFeature


class Qwen2_5_VLProcessor(MultiModalProcessor):
    def __init__(self, hf_config: dict[str, Any], model_dir: str | None) -> None:
        super().__init__()
        vision = hf_config["vision_config"]
        self.merge = int(vision.get("spatial_merge_size", 2))
        self.placeholder_token_id = int(hf_config.get("image_token_id", 151655))
        self.start_id = int(hf_config.get("vision_start_token_id", 151652))
        self.end_id = int(hf_config.get("vision_end_token_id", 151653))
        self.image_processor = _image_processor(vision, model_dir)
        self.placeholder_text = ""  # set by ``bind_tokenizer``

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """The text of one image in a message: vision start, the image pad, vision end."""
        ids = [self.start_id, self.placeholder_token_id, self.end_id]
        self.placeholder_text = tokenizer.decode(ids, skip_special_tokens=False)

    @property
    def settings_key(self) -> str:
        p = self.image_processor
        return f"qwen2_5_vl|{p.patch_size}|{p.merge_size}|{p.temporal_patch_size}|{_pixels(p)}"

    def process_image(self, image: Any) -> tuple[dict[str, np.ndarray], int]:
        out = self.image_processor(images=[image], return_tensors="np")
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        grid = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(1, 3)
        tokens = int(grid.prod()) // self.merge**2
        return {"pixel_values": pixels, "image_grid_thw": grid}, tokens

    def positions(
        self, token_ids: list[int], features: list[MultiModalFeature]
    ) -> tuple[np.ndarray, int]:
        """Text runs count up by one on all three rows; an image's tokens take (start, start +
        row, start + column) of its merged grid, and the text after it starts past the larger
        side (transformers' ``get_rope_index`` for images)."""
        n = len(token_ids)
        pos = np.empty((3, n), dtype=np.int64)
        cur, prev = 0, 0
        for f in features:
            text = f.offset - prev
            pos[:, prev : f.offset] = np.arange(cur, cur + text)
            cur += text
            t, h, w = (int(x) for x in f.data["image_grid_thw"][0])
            h, w = h // self.merge, w // self.merge
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            pos[:, f.offset : f.end] = np.stack([tt, hh, ww]).reshape(3, -1) + cur
            cur += max(h, w)
            prev = f.end
        pos[:, prev:] = np.arange(cur, cur + n - prev)
        return pos, int(pos.max()) + 1 - n


def _pixels(p: Any) -> str:
    size = getattr(p, "size", None) or {}
    return f"{size.get('shortest_edge')}-{size.get('longest_edge')}"


def _image_processor(vision: dict[str, Any], model_dir: str | None) -> Any:
    """The checkpoint's image processor (preprocessor_config.json), else one from the vision
    config's patch sizes; the PIL backend, which needs no torchvision."""
    # NOTE: transformers' image processors load only where a processor is built.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    kwargs = {
        "patch_size": int(vision.get("patch_size", 14)),
        "temporal_patch_size": int(vision.get("temporal_patch_size", 2)),
        "merge_size": int(vision.get("spatial_merge_size", 2)),
    }
    if model_dir and (Path(model_dir) / "preprocessor_config.json").is_file():
        return Qwen2VLImageProcessorPil.from_pretrained(model_dir, **kwargs)
    return Qwen2VLImageProcessorPil(**kwargs)
