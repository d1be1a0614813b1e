"""``freescale demo``: the main job on the embedded default (filled in with the planner)."""


def register(sub) -> None:
    pass
