"""The engine's kernels and their measured choice: the linear kernels (``linear``), the
per-machine measurement that picks one per weight shape (``choice``), and pdserve's
compiled CPU kernels (``cpu``).
"""
