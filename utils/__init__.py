"""Plumbing shared by the trainers: environments, the chunked driver, checkpoints, logs, plots.

Nothing in here is algorithm: if you would edit it to change how an agent learns, the code
belongs in the trainer script instead.
"""
