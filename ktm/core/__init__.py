"""What a merged prompt is: prompt segments, token ids, the K-token merging encoder, prefixes
and packed batches, LoRA placement, the checkpoint files and loading a base model.
"""
