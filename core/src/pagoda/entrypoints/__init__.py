"""What users call: ``LLM``, the ``pagoda`` command line, the OpenAI-compatible server.

Floor: faces, the top. Imports anything below; nothing in the core imports it (but for the package
face's lazy ``pagoda.LLM``).
"""
