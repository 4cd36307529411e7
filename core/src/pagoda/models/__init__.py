"""The core's own model implementations (the Llama family) and their parallel layers.

Floor: contracts and features. Imports attention, ops, the loader and the parallel state; a
model never knows the runner that calls it. ``impl.py`` is the model-impl contract and its
selection (``model.impl``); ``native.py`` serves the Llama family as the impl ``native``. Other
architectures come from plugins' impls (``register_model_impls``).
"""
