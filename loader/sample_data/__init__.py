"""Bundled sample data: MovieLens ml-latest-small ratings (see ``ml-latest-small/README.txt``)."""

from __future__ import annotations

from pathlib import Path


def movielens_ratings_path() -> Path:
    """Path of the bundled ``ratings.csv`` (100,836 ratings by 610 users; userId,movieId,rating,timestamp)."""
    return Path(__file__).parent / "ml-latest-small" / "ratings.csv"


MOVIELENS_COLUMNS = {"user_col": "userId", "item_col": "movieId", "time_col": "timestamp"}  # ratings.csv's


def convert_movielens(out, *, ratings: bool = True, **kwargs) -> dict:
    """The bundled ratings as per-user histories in the data contract at ``out`` (replacing an earlier
    conversion there); ``ratings``: carry each rating as a per-event feature. ``kwargs`` go to
    :func:`loader.contract.convert.convert_events`; returns its summary."""
    from loader.contract.convert import convert_events

    return convert_events(movielens_ratings_path(), out, **MOVIELENS_COLUMNS,
                          feature_cols=("rating",) if ratings else (), overwrite=True, **kwargs)
