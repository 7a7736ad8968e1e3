"""The efficiency benchmark (``ktm bench``): timed runs of the one decode path and of training
steps, the serve load test, and plots of its JSON rows.
"""
