"""The core's own model implementations (the Llama family) and their parallel layers.

Floor: contracts and features. Imports attention, ops, the loader and the parallel state; a
model never knows the runner that calls it. Other architectures are registered by plugins
(``register_models``).
"""
