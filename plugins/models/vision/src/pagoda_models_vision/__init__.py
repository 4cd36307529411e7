"""Pagoda's native vision-language models (a plugin distribution: ``pagoda-models-vision``)."""
