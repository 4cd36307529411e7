"""LoRA adapters served on one base model (features floor).

``peft.py`` reads and checks an adapter in PEFT's layout; ``layers.py`` wraps the model's
column- and row-parallel linears with the batched LoRA path; ``slots.py`` holds the adapters in
host memory and in the device slots (both least recently used); ``resolver.py`` is the adapter
resolver contract and the built-in local-folder resolver. The kernels are ``pagoda.ops.lora``.
"""
