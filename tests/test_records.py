import pytest

from otel_hicache.records import TransferRecord, submission, validate


def make(direction="offload", pools=None, num_bytes=0, page_size=64):
    return TransferRecord(submission(direction, {"kv": 1408} if pools is None else pools, num_bytes, page_size))


def test_anchor_pool_is_the_token_count_and_blocks_round_up():
    record = make(pools={"kv": 1408, "swa": 512, "mamba": 3}, num_bytes=161_480_704)
    validate(record)
    assert record.tokens == 1408  # the first pool, never the sum
    assert record.blocks == 22
    assert record.pool_names == ("kv", "swa", "mamba")
    assert record.pool_tokens == (1408, 512, 3)
    record = make(pools={"kv": 65})
    validate(record)
    assert record.blocks == 2


def test_empty_pools_mean_zero_tokens():
    record = make(pools={})
    validate(record)
    assert (record.tokens, record.blocks, record.pool_names) == (0, 0, ())


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"direction": "sideways"}, ValueError, "direction"),
        ({"pools": {"kv": -1}}, ValueError, "tokens_by_pool['kv'] must be >= 0"),
        ({"pools": {"kv": 1.5}}, TypeError, "tokens_by_pool['kv'] must be an integer"),
        ({"pools": {"kv": True}}, TypeError, "bool"),
        ({"pools": [("kv", 1)]}, TypeError, "mapping"),
        ({"pools": {3: 1}}, TypeError, "keys"),
        ({"num_bytes": -5}, ValueError, "num_bytes must be >= 0"),
        ({"num_bytes": "12"}, TypeError, "num_bytes must be an integer"),
        ({"page_size": 0}, ValueError, "page_size must be >= 1"),
        ({"page_size": 2.0}, TypeError, "page_size"),
    ],
)
def test_invalid_input_names_the_problem(kwargs, error, text):
    with pytest.raises(error, match=None) as info:
        validate(make(**kwargs))
    assert text in str(info.value)


def test_integer_like_counts_and_str_enum_pool_names_are_accepted():
    import enum

    import torch

    class Pool(str, enum.Enum):
        KV = "kv"
        SWA = "swa"

    record = make(pools={Pool.KV: torch.tensor(128), Pool.SWA: 64}, num_bytes=torch.tensor(4096), page_size=64)
    validate(record)
    assert record.pool_names == ("kv", "swa") and all(type(n) is str for n in record.pool_names)
    assert (record.tokens, record.blocks, record.num_bytes) == (128, 2, 4096)
    assert type(record.num_bytes) is int


def test_negative_page_size_names_the_bound():
    with pytest.raises(ValueError, match="page_size must be >= 1, got -64"):
        validate(make(page_size=-64))
