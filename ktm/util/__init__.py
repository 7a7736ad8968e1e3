"""Small leaf helpers every layer may use: crash-safe file writes, provenance, device-aware
timing, config field checks, the runtime options an engine of its own fixes. They import nothing
of ktm but ``ktm.errors``.
"""
