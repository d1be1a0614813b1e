"""loader package: the data contract, dataset tools, and ``SequenceLoader`` (docs/loader.md).

``SequenceLoader`` and ``Microbatch`` are imported on first use, so the dataset tools
(``loader.contract.schema``, ``loader.contract.convert``, ...) do not pay for torch.
"""

__all__ = ["Microbatch", "SequenceLoader"]


def __getattr__(name: str):
    if name == "SequenceLoader":
        from loader.sequence import SequenceLoader

        return SequenceLoader
    if name == "Microbatch":
        from loader.microbatch import Microbatch

        return Microbatch
    raise AttributeError(f"module 'loader' has no attribute {name!r}")
