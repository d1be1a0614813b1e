"""The loader's pure stages, in the order a row group passes them: decode (:mod:`.decode`), validate and
truncate (:mod:`.clean`), the epoch order (:mod:`.order`), one epoch driven block by block and planned
(:mod:`.pipeline`), each rank's messages (:mod:`.assemble`), the jagged rows and their gather (:mod:`.rows`,
:mod:`.kernels`); beside them the node layout (:mod:`.nodes`), the counts (:mod:`.stats`), the resumable state
(:mod:`.state`) and the steps as lengths for reports (:mod:`.lengths`). No Ray, no torch, no asyncio: functions
of their inputs, so both backends and the offline tools run the same code (tests/test_layering.py)."""
