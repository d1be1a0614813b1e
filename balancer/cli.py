"""``freescale plan``: balance metrics of every planner on a real dataset (filled in with the planner)."""


def register(sub) -> None:  # replaced when the planner lands
    pass
