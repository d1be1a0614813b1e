"""Bundled data of :mod:`analysis`: ``length_histograms.json`` (real history-length histograms) and its builder."""
