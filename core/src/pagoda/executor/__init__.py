"""Executors: how the engine core reaches its workers. The contract (``base.py``), the in-process
one, and the machinery that multiprocess and Ray executors share (worker processes, their ZMQ
channel and messages).

Floor: executor, above the scheduler and the worker: transport only. It carries the step
messages (``pagoda.step``) and never reads the scheduler.
"""
