"""Small leaf helpers every layer may use: crash-safe file writes, provenance, device-aware
timing, config field checks. They import nothing of ktm but ``ktm.errors``.
"""
