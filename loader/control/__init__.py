"""The loader's control plane, one for both backends: runs (:mod:`.runs`), production (:mod:`.production`),
routing (:mod:`.routing`) and liveness (:mod:`.liveness`) behind :class:`.service.Service`; the typed boundary
to readers and ranks (:mod:`.protocol`); a trainer process's side of it (:mod:`.stream`). Plain asyncio: no
Ray, no torch (tests/test_layering.py)."""
