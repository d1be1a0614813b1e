"""Cost-model files: a :class:`balancer.CostModel` as JSON ``{"quadratic": q, "linear": l, "constant": c}``
(seconds per sample of length L; ``r2`` is kept when a fit wrote it). ``balancer`` stays free of file I/O;
``freescale plan``, ``report``, ``simulate`` and ``demo`` read their ``--cost-model`` here."""

from __future__ import annotations

import json
from pathlib import Path

from balancer import CostModel


def save_cost_model(model: CostModel, path: str | Path) -> None:
    Path(path).write_text(json.dumps(model.to_dict(), indent=2) + "\n")


def load_cost_model(path: str | Path) -> CostModel:
    """The cost model in the JSON file ``path``; errors name the file and what is wrong in it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: cost-model file not found; write one with analysis.costfile.save_cost_model")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a JSON cost model ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a cost model is a JSON object with quadratic, linear, constant; "
                         f"got {type(data).__name__}")
    try:
        return CostModel.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
