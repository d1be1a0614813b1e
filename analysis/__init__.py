"""Offline analysis above the loader: epoch evaluation of the planners, the report's numbers, the bubble
simulator (which also reads the trainer's JSONL step records), synthetic data (``workloads``: length
distributions; ``synth``: datasets in the data contract) and cost-model files (``costfile``).

Layering: ``analysis`` may import ``balancer`` and ``loader``; ``balancer`` (cost model, planners, their
kernels) imports neither, and no file reader (``tests/test_layering.py``). The CLI (``freescale``) calls
these modules.
"""
