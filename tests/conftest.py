import os
import tempfile

# numba's cache=True needs a writable folder; an installed package may be read-only.
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(tempfile.gettempdir(), "freescale-numba-cache"))
