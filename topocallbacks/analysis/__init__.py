"""The parts of `topocallbacks.analyze.analyze`: loading, evaluating and writing, and what they share.

``checkpoints`` finds and reads the files, ``models`` rebuilds the model, ``summaries`` works across checkpoints.
"""
