"""loader package: the data contract, dataset tools, and ``SequenceLoader`` (docs/loader.md).

``SequenceLoader``, ``Microbatch`` and ``RankStep`` are imported on first use, so the dataset tools
(``loader.contract.schema``, ``loader.contract.convert``, ...) do not pay for torch.
"""

__all__ = ["Microbatch", "RankStep", "SequenceLoader"]


def __getattr__(name: str):
    if name == "SequenceLoader":
        from loader.sequence import SequenceLoader

        return SequenceLoader
    if name in ("Microbatch", "RankStep"):
        from loader import microbatch

        return getattr(microbatch, name)
    raise AttributeError(f"module 'loader' has no attribute {name!r}")
