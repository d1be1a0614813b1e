import numpy as np
import pyarrow as pa
import pytest

from loader.contract.schema import Columns, contract_schema, list_array, type_name, validate_schema

PATH = "data/part-0.parquet"


def _schema(**fields: pa.DataType) -> pa.Schema:
    return pa.schema(list(fields.items()))


def test_canonical_schema_validates_and_reports_features():
    schema = contract_schema(features={"ratings": pa.float32(), "action": pa.int8()})
    assert schema.names == ["user_id", "item_ids", "timestamps", "ratings", "action"]
    assert schema.field("item_ids").type == pa.list_(pa.int64())
    assert validate_schema(schema, PATH) == ("ratings", "action")


def test_timestamps_optional():
    schema = contract_schema(timestamps=False)
    assert schema.names == ["user_id", "item_ids"]
    assert validate_schema(schema, PATH) == ()
    assert validate_schema(schema, PATH, Columns(timestamps=None)) == ()


@pytest.mark.parametrize("missing", ["user_id", "item_ids"])
def test_missing_required_column_names_file_column_and_fix(missing):
    schema = contract_schema().remove(contract_schema().get_field_index(missing))
    with pytest.raises(ValueError, match=rf"{PATH}: required column '{missing}'.*missing") as err:
        validate_schema(schema, PATH)
    assert "columns present" in str(err.value) and "columns=" in str(err.value)


@pytest.mark.parametrize(
    "column, bad, shown",
    [
        ("item_ids", pa.list_(pa.string()), "list<string>"),
        ("item_ids", pa.list_(pa.float64()), "list<double>"),
        ("item_ids", pa.int64(), "int64"),
        ("item_ids", pa.list_(pa.uint64()), "list<uint64>"),
        ("timestamps", pa.list_(pa.float32()), "list<float>"),
        ("user_id", pa.string(), "string"),
        ("user_id", pa.float64(), "double"),
    ],
)
def test_wrong_type_names_file_column_and_types(column, bad, shown):
    fields = {"user_id": pa.int64(), "item_ids": pa.list_(pa.int64()), "timestamps": pa.list_(pa.int64())}
    fields[column] = bad
    with pytest.raises(ValueError, match=rf"{PATH}: column '{column}' has type {shown}, expected"):
        validate_schema(_schema(**fields), PATH)


def test_error_matches_documented_example():
    schema = _schema(user_id=pa.int64(), item_ids=pa.list_(pa.string()))
    expected = (
        "data/part-0.parquet: column 'item_ids' has type list<string>, expected list<int64> "
        "(integer item ids)"
    )
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        validate_schema(schema, PATH)


@pytest.mark.parametrize(
    "list_type", [pa.list_(pa.int32()), pa.large_list(pa.int64()), pa.list_(pa.uint32()), pa.list_(pa.int8())]
)
def test_lossless_integer_lists_accepted(list_type):
    schema = _schema(user_id=pa.int32(), item_ids=list_type, timestamps=list_type)
    assert validate_schema(schema, PATH) == ()


def test_custom_column_names():
    columns = Columns(user="uid", items="seq", timestamps="ts")
    schema = _schema(uid=pa.int64(), seq=pa.list_(pa.int64()), ts=pa.list_(pa.int64()))
    assert validate_schema(schema, PATH, columns) == ()
    with pytest.raises(ValueError, match="required column 'user_id'"):
        validate_schema(schema, PATH)


def test_only_numeric_list_columns_are_features():
    schema = _schema(
        user_id=pa.int64(),
        item_ids=pa.list_(pa.int64()),
        rating=pa.list_(pa.float32()),
        tags=pa.list_(pa.string()),
        split=pa.string(),
        weight=pa.float64(),
    )
    assert validate_schema(schema, PATH) == ("rating",)


def test_columns_must_be_distinct_and_named():
    with pytest.raises(ValueError, match="distinct"):
        Columns(user="x", items="x")
    with pytest.raises(ValueError, match="non-empty"):
        Columns(items="")


def test_non_numeric_feature_rejected():
    with pytest.raises(ValueError, match="feature column 'tag' must be numeric"):
        contract_schema(features={"tag": pa.string()})


def test_list_array_round_trip_and_overflow():
    offsets = np.array([0, 2, 2, 5])  # (n_rows + 1,)
    array = list_array(offsets, np.arange(5))
    assert array.to_pylist() == [[0, 1], [], [2, 3, 4]]
    with pytest.raises(ValueError, match="lower rows_per_group"):
        list_array(np.array([0, 2**31]), np.arange(3))


def test_type_name_is_short():
    assert type_name(pa.large_list(pa.list_(pa.int32()))) == "large_list<list<int32>>"
