"""Benchmarks behind ``pagoda bench``: workloads, peers, roofline figures and reports.

Floor: faces. It drives the engine from above like a user; nothing in the core imports it.
"""
