"""``freescale synth`` and ``freescale convert`` (filled in by the data-contract work)."""


def register(sub) -> None:
    pass
