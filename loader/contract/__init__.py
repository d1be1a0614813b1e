"""The data contract (docs/data.md): one Parquet row per history. Its schema and column roles (:mod:`.schema`),
the index of a source's row groups read from the footers (:mod:`.sources`), and its writers: the part-file
layout (:mod:`.layout`) and ``freescale convert`` (:mod:`.convert`). No Ray, no torch."""
