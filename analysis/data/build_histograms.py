"""Rebuild ``length_histograms.json``: per-user history-length histograms of public recommendation datasets.

Every source is a file of a public GitHub repository at a recorded commit, named by its git blob id (checked
here, so a rebuilt file counts exactly the bytes recorded). Lay the files out as ``SOURCES/<owner>/<name>/<path>``
(e.g. from ``https://raw.githubusercontent.com/<owner>/<name>/<commit>/<path>``) and run, from the repository
root::

    python -m analysis.data.build_histograms SOURCES [--out analysis/data/length_histograms.json]

The bundled MovieLens sample is read from this repository (``loader/sample_data``). Only the number of
interactions per user is kept: no ids, no items. A user's length counts every interaction line of that user in
the listed files (train, validation and test splits of one dataset are summed back together).

Formats: ``user-lines`` (one line per user: ``user item item ...``; a user may have a line in each split file),
``pair-lines`` (one line per interaction: ``user item``), ``csv`` (a header, then rows whose ``userId`` column
names the user).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from analysis.workloads import HISTOGRAMS, histogram_quantile

REPO_ROOT = Path(__file__).resolve().parents[2]
THIS_REPO = "this repository"

S3REC = ("RUCAIBox/CIKM2020-S3Rec", "2a81540ae18615d88ef88227b0c066e5b74781e5")
S3REC_NOTE = ("as preprocessed by the S3-Rec authors (CIKM 2020): 5-core (users and items with fewer than "
              "5 interactions removed), one time-ordered sequence per user")
MULSETRANK = ("NoConst/MulSetRank", "4016c6315257ea090fbc07adb1bea56348c488d0")


@dataclass(frozen=True)
class Source:
    name: str
    title: str
    repo: str
    commit: str
    files: tuple[tuple[str, str], ...]  # (path, git blob id)
    format: str
    preprocessing: str


SOURCES = (
    Source("ml-latest-small", "MovieLens ml-latest-small (the bundled sample: 610 users)", THIS_REPO, "",
           (("loader/sample_data/ml-latest-small/ratings.csv", "ca23ddf4479457d3e617a983b1424b1af610bdc7"),),
           "csv",
           "none: GroupLens' ml-latest-small as published (2018-09-26): 610 users picked at random among those "
           "with at least 20 ratings; every rating is an event"),
    Source("ml-1m", "MovieLens 1M", *MULSETRANK,
           (("data/ml-1m/train.txt", "52ca183e41c05793c2886f4b7c74fae9b69c0d5a"),
            ("data/ml-1m/test.txt", "2696457ad5c9928f5d8d4f550ba18e6fd8959305")),
           "user-lines",
           "none: all 1,000,209 ratings of the 6,040 users (every ML-1M user has at least 20), split 80/20 per "
           "user by the repo and summed back here; LIN452/ReSN@a190a07's copy (data/ml-1m) gives the same "
           "histogram"),
    Source("amazon-beauty", "Amazon Beauty (reviews)", *S3REC,
           (("data/Beauty.txt", "a29773026846d857ec8176cb25f37b23ecf20155"),), "user-lines", S3REC_NOTE),
    Source("amazon-sports", "Amazon Sports and Outdoors (reviews)", *S3REC,
           (("data/Sports_and_Outdoors.txt", "50a7023ca502b42eb0e840c603abda6e851b2018"),), "user-lines",
           S3REC_NOTE),
    Source("amazon-toys", "Amazon Toys and Games (reviews)", *S3REC,
           (("data/Toys_and_Games.txt", "5459307b30f65949605b34d350bfad37586a1b97"),), "user-lines",
           S3REC_NOTE),
    Source("amazon-games", "Amazon Video Games (reviews; SASRec's 'Games')", "kang205/SASRec",
           "e3738967fddab206d6eeb4fda433e7a7034dd8b1",
           (("data/Video.txt", "f576455c76008a2c02a178c9d4ee930be632af89"),), "pair-lines",
           "as preprocessed by the SASRec authors (ICDM 2018, data/DataProcessing.py): one pass dropping reviews "
           "whose user or item has fewer than 5 reviews in the raw data, so 1,672 users end with fewer than 5"),
    Source("amazon-book", "Amazon Books (ratings as implicit feedback)", *MULSETRANK,
           (("data/amazon-book/train.txt", "af17875a232fbcf27f08270c77fecefe9e4d9806"),
            ("data/amazon-book/test.txt", "2b34f222772f224522740242b09ae2e48b395410")),
           "user-lines",
           "as processed by the MulSetRank authors (filtering not documented; every user has at least 4 "
           "interactions); the repo's whole-set data.txt is too large for the snapshot, so its 80/20 split "
           "is summed back (for Ciao, the same repo's split holds 0.18% fewer events than its data.txt)"),
    Source("yelp", "Yelp (reviews)", *S3REC,
           (("data/Yelp.txt", "d0f642c11487b3bcb515249d676aa1e37a1bb99e"),), "user-lines", S3REC_NOTE),
    Source("lastfm", "Last.fm (HetRec 2011 lastfm-2k, tag assignments to artists)", *S3REC,
           (("data/LastFM.txt", "3c46bd58d4c8582d0496fe42570af06d977b58db"),), "user-lines", S3REC_NOTE),
    Source("gowalla", "Gowalla (location check-ins)", "geon0325/LightGCNpp",
           "a394f79a7aceb8f485f6bcb549b4865fe83f1d49",
           (("data/gowalla/train.txt", "55340a5eed71a842b63107a089520f486c98d1d4"),
            ("data/gowalla/valid.txt", "9d86bd6e70f7975def76899c66d83d548ba4ab61"),
            ("data/gowalla/test.txt", "9ed5af4b5d21511f33740b4e22e3852f45671800")),
           "user-lines",
           "the NGCF/LightGCN 10-core Gowalla: distinct user-place pairs (29,858 users, 1,027,370 pairs, "
           "the LightGCN paper's figures); train/valid/test summed back (test.txt is the same blob as "
           "gusye1234/LightGCN-PyTorch's)"),
    Source("wikipedia", "Wikipedia page edits (JODIE)", "pmixer/SASRec.pytorch",
           "fde8a9c08febc2c898dc269b1d98ab762c50d2be",
           (("python/data/wikipedia.txt", "2f86c4f70a7988852eb09d2806281bd6c1917b83"),), "pair-lines",
           "none beyond JODIE's (KDD 2019: a month of edits to the 1,000 most edited pages by editors with "
           "at least 5 edits): every edit is an event, repeated edits of one page included (157,474 edits "
           "by 8,227 users; 3,054 of them edited these pages once)"),
    Source("epinions", "Epinions (product ratings, Massa and Avesani)", *MULSETRANK,
           (("data/epinions/data.txt", "2db805dd2edf7c8f0b0c67235bf415600cc37a2a"),), "user-lines",
           "ratings as implicit feedback, no core filtering (664,823 ratings by the 40,163 users who rated)"),
    Source("ciao", "Ciao (product ratings, Tang et al.)", *MULSETRANK,
           (("data/ciao/data.txt", "a9d9134566c429cf84a50046211d1e4db3859d06"),), "user-lines",
           "ratings as implicit feedback, no core filtering (284,086 ratings by 7,375 users)"),
    Source("citeulike-t", "CiteULike-t (articles saved to users' libraries)", *MULSETRANK,
           (("data/citeulike/data.txt", "8159c0b3b8955a4fc8ac2ed187cde81360a7eb59"),), "user-lines",
           "as published by Wang et al. (IJCAI 2013): users with at least 3 articles (134,860 saves by "
           "7,947 users)"),
)


def blob_id(data: bytes) -> str:
    """The git blob id of ``data`` (what ``git hash-object`` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def read_source(root: Path, src: Source, path: str, expected_blob: str) -> str:
    file = REPO_ROOT / path if src.repo == THIS_REPO else root / src.repo / path
    data = file.read_bytes()
    if blob_id(data) != expected_blob:
        raise ValueError(f"{file}: git blob {blob_id(data)}, expected {expected_blob} "
                         f"({src.repo}@{src.commit or 'HEAD'}:{path}); fetch that exact file")
    return data.decode("utf-8")


def user_counts(texts: list[str], fmt: str) -> Counter:
    """Interactions per user over all ``texts`` (one dataset's files)."""
    counts: Counter = Counter()
    for text in texts:
        if fmt == "csv":
            for row in csv.DictReader(text.splitlines()):
                counts[row["userId"]] += 1
            continue
        for line in text.splitlines():
            tokens = line.split()
            if not tokens:
                continue
            if fmt == "user-lines":
                counts[tokens[0]] += len(tokens) - 1
            elif fmt == "pair-lines":
                if len(tokens) != 2:
                    raise ValueError(f"pair-lines: expected 'user item', got {line!r}")
                counts[tokens[0]] += 1
            else:
                raise ValueError(f"unknown format {fmt!r}")
    return counts


def entry(src: Source, root: Path) -> dict:
    texts = [read_source(root, src, path, blob) for path, blob in src.files]
    per_user = np.array([c for c in user_counts(texts, src.format).values() if c > 0], dtype=np.int64)
    lengths, counts = np.unique(per_user, return_counts=True)
    return {
        "name": src.name,
        "title": src.title,
        "source": {"repo": src.repo, "commit": src.commit or None,
                   "files": [{"path": p, "blob": b} for p, b in src.files], "format": src.format},
        "preprocessing": src.preprocessing,
        "users": int(counts.sum()),
        "events": int((lengths * counts).sum()),
        "min": int(lengths[0]),
        "median": histogram_quantile(lengths, counts, 0.5),
        "p99": histogram_quantile(lengths, counts, 0.99),
        "max": int(lengths[-1]),
        "histogram": [[int(length), int(count)] for length, count in zip(lengths, counts)],
    }


def dump(datasets: list[dict]) -> str:
    """JSON with one histogram per line, so a diff shows which dataset changed."""
    head = {
        "about": "Per-user history lengths (interactions per user, before any truncation) of public "
                 "recommendation datasets; histogram = [length, users with that length] pairs, lengths "
                 "ascending, zero counts left out. median/p99: the smallest length with at least 50%/99% of "
                 "users at or below it. Rebuilt by analysis/data/build_histograms.py; read by "
                 "analysis.workloads.dataset_lengths.",
    }
    body = ",\n".join("    " + json.dumps(d, separators=(",", ":")) for d in datasets)
    return json.dumps(head, indent=2)[:-2] + ',\n  "datasets": [\n' + body + "\n  ]\n}\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", type=Path, help="folder holding <owner>/<name>/<path> of every source file")
    parser.add_argument("--out", type=Path, default=HISTOGRAMS)
    args = parser.parse_args(argv)
    datasets = [entry(src, args.sources) for src in SOURCES]
    args.out.write_text(dump(datasets))
    for d in datasets:
        print(f"{d['name']:16s} users {d['users']:>7,} events {d['events']:>10,} median {d['median']:>4} "
              f"p99 {d['p99']:>5} max {d['max']:>5}")
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
