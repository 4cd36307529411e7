"""The model's multimodal processor: a prompt's images into placeholder tokens and encoder
inputs. A vision-language model class provides one (``multimodal_processor``); this module holds
the contract, the image hash and the cache of processed images keyed by it."""

from __future__ import annotations

import hashlib
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any

import numpy as np

from pagoda.multimodal_inputs import MultiModalFeature, MultiModalInputs


def image_hash(image: Any, salt: str = "") -> str:
    """SHA-256 of an RGB ``PIL.Image``'s size and pixels (and ``salt``: the processor's
    settings), hex: equal hashes mean equal encoder outputs."""
    h = hashlib.sha256()
    h.update(f"{salt}|{image.mode}|{image.width}x{image.height}|".encode())
    h.update(image.tobytes())
    return h.hexdigest()


class ProcessorCache:
    """Processed images (encoder inputs and token counts) by image hash, least recently used
    out first; shared by the front end's threads."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, np.ndarray], int]] = OrderedDict()
        self._lock = threading.Lock()
        self.queries = 0
        self.hits = 0

    def get(self, key: str) -> tuple[dict[str, np.ndarray], int] | None:
        with self._lock:
            self.queries += 1
            item = self._items.get(key)
            if item is not None:
                self.hits += 1
                self._items.move_to_end(key)
            return item

    def put(self, key: str, item: tuple[dict[str, np.ndarray], int]) -> None:
        with self._lock:
            self._items[key] = item
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)


class MultiModalProcessor(ABC):
    """What a vision-language family provides to the front end (``docs/plugins.md``).

    A prompt names each image with one ``placeholder_token_id``; :meth:`process` expands it to
    the image's tokens and returns each image's feature (its hash, placeholder range, encoder
    inputs) and, for M-RoPE models, the prompt's 3-D positions.
    """

    #: The modalities the model takes (``multi_modal_data``'s keys).
    modalities: tuple[str, ...] = ("image",)
    #: The token that stands for one image in a prompt, before expansion.
    placeholder_token_id: int
    #: What an ``image_url`` chat part becomes in the message text (it holds the placeholder).
    placeholder_text: str

    def __init__(self) -> None:
        self.cache = ProcessorCache()

    @property
    @abstractmethod
    def settings_key(self) -> str:
        """The processor's settings that change its output (folded into each image's hash)."""

    @abstractmethod
    def process_image(self, image: Any) -> tuple[dict[str, np.ndarray], int]:
        """One RGB ``PIL.Image``: the encoder's inputs and how many tokens it becomes."""

    def positions(
        self, token_ids: list[int], features: list[MultiModalFeature]
    ) -> tuple[np.ndarray, int] | None:
        """The prompt's rotary positions ([3, len] int64) and the offset of the positions past
        it, for an M-RoPE model; None (the default): position i is i."""
        return None

    def process(
        self, token_ids: list[int], images: list[Any]
    ) -> tuple[list[int], MultiModalInputs]:
        """Expand each placeholder of ``token_ids`` to its image's tokens (images in order)."""
        slots = [i for i, t in enumerate(token_ids) if t == self.placeholder_token_id]
        if len(slots) != len(images):
            raise ValueError(
                f"the prompt has {len(slots)} image placeholders ({self.placeholder_text!r}) for"
                f" {len(images)} images in multi_modal_data; give one placeholder per image"
            )
        out: list[int] = []
        features: list[MultiModalFeature] = []
        prev = 0
        for slot, image in zip(slots, images):
            key = image_hash(image, self.settings_key)
            item = self.cache.get(key)
            if item is None:
                item = self.process_image(image)
                self.cache.put(key, item)
            data, n = item
            out += token_ids[prev:slot]
            features.append(MultiModalFeature("image", key, len(out), n, data))
            out += [self.placeholder_token_id] * n
            prev = slot + 1
        out += token_ids[prev:]
        pos = self.positions(out, features)
        if pos is None:
            return out, MultiModalInputs(features)
        return out, MultiModalInputs(features, pos[0], pos[1])
