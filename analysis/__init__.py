"""Offline analysis above the loader: epoch evaluation of the planners, the report's numbers and the bubble
simulator (which also reads the trainer's JSONL step records).

Layering: ``analysis`` may import ``balancer`` and ``loader``; ``balancer`` (cost model, planners, their
kernels) imports neither (``tests/test_layering.py``). The CLI (``freescale plan``, ``report``, ``simulate``)
calls these modules.
"""
