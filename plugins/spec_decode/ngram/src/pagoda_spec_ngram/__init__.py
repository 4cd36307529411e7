"""Prompt-lookup n-gram speculative proposer for Pagoda (``speculative.method: ngram``)."""
