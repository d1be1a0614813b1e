"""``Microbatch.as_nested``: a jagged-layout nested tensor over a column, without copying it, that attention
takes as it is: SDPA over the nested embeddings equals a padded, masked reference."""

import pytest
import torch
import torch.nn.functional as F

from loader import SequenceLoader
from tests.loader.helpers import synth


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("nested") / "d", users=120, max_len=40)


def microbatches(data):
    with SequenceLoader(data, ranks=2, microbatches=2, samples_per_step=40, backend="inline", seed=3) as loader:
        return [mb for step in loader.iter_steps() for rank in step for mb in rank]


def test_nested_views_every_column_without_a_copy(data):
    for mb in microbatches(data):
        for column, values in [("item_ids", mb.item_ids), ("timestamps", mb.timestamps), *mb.features.items()]:
            nested = mb.as_nested(column)
            assert nested.layout == torch.jagged and nested.size(0) == mb.num_samples
            assert nested.values().data_ptr() == values.data_ptr()  # the microbatch's own buffer
            rows = [values[a:b] for a, b in zip(mb.offsets[:-1].tolist(), mb.offsets[1:].tolist())]
            assert all(torch.equal(got, want) for got, want in zip(nested.unbind(), rows))


def test_unknown_column_is_named(data):
    mb = microbatches(data)[0]
    with pytest.raises(ValueError, match=r"no column 'rating' in this microbatch; it has item_ids, timestamps"):
        mb.as_nested("rating")


# torch's CPU SDPA over jagged tensors runs through its strided nested layout, which warns that it is a prototype
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_attention_over_nested_equals_the_padded_reference(data):
    torch.manual_seed(0)
    heads, dim = 2, 8
    embed = torch.nn.Embedding(int(max(mb.item_ids.max() for mb in microbatches(data))) + 1, heads * dim)
    with torch.no_grad():
        for mb in microbatches(data):
            if mb.num_samples == 0:
                continue
            items = mb.as_nested("item_ids")
            x = torch.nested.nested_tensor_from_jagged(embed(items.values()), items.offsets())  # (n, j, H*D)
            q = x.unflatten(-1, (heads, dim)).transpose(1, 2)  # (n, H, j, D)
            out = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(-2).values()  # (T, H*D)

            lengths = mb.offsets.diff()
            padded = torch.nested.to_padded_tensor(x, 0.0)  # (n, L, H*D)
            keep = torch.arange(padded.size(1)) < lengths[:, None]  # (n, L): real events
            p = padded.unflatten(-1, (heads, dim)).transpose(1, 2)  # (n, H, L, D)
            ref = F.scaled_dot_product_attention(p, p, p, attn_mask=keep[:, None, None, :])
            ref = ref.transpose(1, 2).flatten(-2)[keep]  # (T, H*D), padding dropped
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
