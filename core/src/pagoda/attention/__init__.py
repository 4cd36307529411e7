"""Attention: the backend contract (``backend.py``), the layer that calls it, the selector and
the core's torch-native reference backend.

Floor: contracts and features. Imports config, the plugin kernel and the leaves (ops, parallel
state); never the scheduler, the worker or the engine. Backends that vary by hardware are
plugins (``register_attention_backends``).
"""
