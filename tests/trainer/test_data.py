"""trainer.data.write_split: one read of the dataset, item ids written as table rows; the held-out set read back
through the loader (trainer.evaluate.read_heldout)."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loader.contract.schema import contract_schema
from trainer.data import Split, read_histories, write_split
from trainer.evaluate import read_heldout

# raw ids are sparse; users 11 and 13 have fewer than 2 events and leave the split
HISTORIES = {10: [1000, 7, 42], 11: [7], 12: [42, 42, 5, 1000, 9], 13: [], 14: [5, 7]}


def test_split_holds_table_rows_and_the_heldout_set_reads_through_the_loader(tmp_path):
    src = tmp_path / "data"
    src.mkdir()
    table = pa.table({"user_id": list(HISTORIES), "item_ids": list(HISTORIES.values()),
                      "timestamps": [list(range(len(h))) for h in HISTORIES.values()]}, schema=contract_schema())
    pq.write_table(table, src / "part-0.parquet")
    ids = np.unique(np.concatenate([h for h in HISTORIES.values() if h]))  # [5, 7, 9, 42, 1000]
    rows = {user: np.searchsorted(ids, h).tolist() for user, h in HISTORIES.items() if len(h) >= 2}

    split = write_split(src, tmp_path / "work")
    assert split == Split(str(tmp_path / "work" / "train"), str(tmp_path / "work" / "heldout"), num_items=5, rows=3)
    train = read_histories(split.train)
    assert train.users.tolist() == list(rows)
    assert [train.items[a:b].tolist() for a, b in zip(train.offsets[:-1], train.offsets[1:])] == \
        [h[:-1] for h in rows.values()]

    items, offsets = read_heldout(split.heldout)
    got = sorted(items[a:b].tolist() for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()))
    assert got == sorted(rows.values())
