"""What a prompt's images add to a request: each image's placeholder tokens, its hash and the
encoder's inputs, and (M-RoPE models) the prompt's 3-D positions.

A leaf: the request, the step message and the wire carry these types; the front end fills them
(``pagoda.multimodal``), the scheduler plans encoder work by them, the runner encodes from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class MultiModalFeature:
    """One image of a prompt: placeholder tokens ``[offset, offset + length)`` of the prompt
    take the encoder's ``length`` output rows, computed from ``data``."""

    modality: str
    #: The image's hash (its pixels and the processor's settings): the encoder cache's key, and
    #: part of the prefix cache's block hashes.
    identifier: str
    offset: int
    length: int
    #: The encoder's inputs, named as the model's processor names them (``pixel_values``, ...).
    data: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class MultiModalInputs:
    """A prompt's images in prompt order, and its rotary positions when they are not 1-D."""

    features: list[MultiModalFeature]
    #: [3, num_prompt_tokens] int64 (M-RoPE: temporal, height, width); None: position i is i.
    positions: np.ndarray | None = None
    #: Added to the position of every token past the prompt (M-RoPE).
    position_delta: int = 0

    @property
    def end(self) -> int:
        """Past the last placeholder: from there on the prompt is text."""
        return max(f.end for f in self.features)

    def hash_keys(self, start: int, end: int) -> list[str]:
        """The hashes (with offsets) of the images whose placeholders meet ``[start, end)``."""
        return [f"{f.identifier}@{f.offset}" for f in self.features
                if f.offset < end and f.end > start]  # fmt: skip
