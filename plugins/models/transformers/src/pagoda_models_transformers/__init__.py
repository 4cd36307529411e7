"""Pagoda's ``transformers`` model impl: causal LMs built from transformers' modeling code."""
