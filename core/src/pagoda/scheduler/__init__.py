"""The scheduler: it plans token ids and block ids each step, under one rule (each request's
computed tokens catch up with its tokens), with the speculation governor and the draft policy.

Floor: scheduler, beside the worker and independent of it. Its collaborators (the KV cache
manager, the structured-output manager, the draft policy and governor) come through its
constructor, built by the engine; it emits the step message (``pagoda.step``).
"""
