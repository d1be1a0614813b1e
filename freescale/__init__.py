"""FreeScale: load-balanced sequence batching for sequential recommenders.

The library lives in the top-level packages ``balancer`` (cost model and planners), ``loader``
(Parquet sources, Ray and inline backends, per-rank iterators), ``trainer`` and ``cuda_ext``; this
package holds the ``freescale`` command line only.
"""

__version__ = "0.1.0"
