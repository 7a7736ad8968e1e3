"""The one decode path: prefill a merged prefix, decode token by token with the KV cache,
continuous batching on the same state, and token ids -> text pieces.
"""
