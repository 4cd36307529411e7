"""Multimodal inputs in the front end (features floor): images loaded from what users send
(``media``), checked against the limits, and turned by the model's processor into placeholder
tokens and encoder inputs, cached by the image's hash (``processor``)."""

from pagoda.multimodal.media import MediaLimits, MediaSource, load_image
from pagoda.multimodal.processor import MultiModalProcessor, ProcessorCache, image_hash

__all__ = [
    "MediaLimits",
    "MediaSource",
    "MultiModalProcessor",
    "ProcessorCache",
    "image_hash",
    "load_image",
]
