"""Bundled sample data: MovieLens ml-latest-small ratings (see ``ml-latest-small/README.txt``)."""

from __future__ import annotations

from pathlib import Path


def movielens_ratings_path() -> Path:
    """Path of the bundled ``ratings.csv`` (100,836 ratings by 610 users; userId,movieId,rating,timestamp)."""
    return Path(__file__).parent / "ml-latest-small" / "ratings.csv"
