"""Training: the plain loop and its config and on-disk state, several processes, weight
averaging, reader pretraining, the tree curriculum and task distillation.
"""
