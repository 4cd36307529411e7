"""The paged KV cache manager: the block pool with its O(1) free queue, prefix hashing, and
slots per request. No torch: it plans block ids.

Floor: contracts and features. Imports the leaves, the plugin kernel's seams and KV offload
(which sees this package only through its ``BlockSource`` Protocol).
"""
