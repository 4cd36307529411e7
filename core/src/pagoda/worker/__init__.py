"""The worker: it owns one device and its tensors. The model runner (input batch, step buffers,
CUDA graphs, sampling) and the runner's side of speculative decoding: verification, hidden
states, draft slots, verifications launched ahead, greedy verification graphs.

Floor: worker, beside the scheduler and independent of it: it reads the step message
(``pagoda.step``), never the scheduler. Nothing outside this package imports the model runner.
"""
