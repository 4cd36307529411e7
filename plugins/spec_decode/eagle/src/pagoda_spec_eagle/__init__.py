"""EAGLE and EAGLE-3 speculative proposers for Pagoda (``speculative.method: eagle | eagle3``)."""
