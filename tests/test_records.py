import pytest

from otel_hicache.capture.records import TransferRecord, validate

from harness import submission


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
    with pytest.raises(ValueError, match=r"page_size must be >= 1 and < 2\*\*63, got -64"):
        validate(make(page_size=-64))


@pytest.fixture
def undrained(monkeypatch):
    """A TransferTelemetry whose pipeline has no poller thread: what submit() queues stays as built."""
    from types import SimpleNamespace

    from otel_hicache.capture import telemetry
    from otel_hicache.capture.poller import Poller

    monkeypatch.setattr(Poller, "_start_thread", lambda self: setattr(
        self, "thread", SimpleNamespace(is_alive=lambda: False, join=lambda timeout=None: None)))
    monkeypatch.setattr(telemetry, "_get_current_context", lambda: "<parent_context>")
    now = SimpleNamespace(ns=0)
    tel = telemetry.TransferTelemetry(clock=lambda: now.ns)
    yield tel, now
    tel.shutdown()


def test_submit_builds_its_list_in_the_declared_layout(undrained):
    """submit() spells SUBMISSION_FIELDS out as a list literal (for speed): each
    argument, the clock and the context must land at its declared index."""
    import inspect

    from otel_hicache.capture.records import S_ACK_NS, S_SUBMIT_NS, SUBMISSION_FIELDS

    tel, now = undrained
    given = [name for name in SUBMISSION_FIELDS if name not in ("submit_ns", "parent_context", "ack_ns")]
    assert [p for p in inspect.signature(tel.submit).parameters] == given
    sentinel = {name: f"<{name}>" for name in SUBMISSION_FIELDS}
    now.ns = sentinel["submit_ns"]
    handle = tel.submit(**{name: sentinel[name] for name in given if name != "host_start_ns"})
    assert handle == [None if name in ("host_start_ns", "ack_ns") else sentinel[name] for name in SUBMISSION_FIELDS]
    now.ns = sentinel["ack_ns"]
    tel.ack(handle)
    assert handle[S_ACK_NS] == sentinel["ack_ns"]
    handle = tel.submit(**{name: sentinel[name] for name in given})  # host_start_ns is then also the submit time
    assert handle[SUBMISSION_FIELDS.index("host_start_ns")] == handle[S_SUBMIT_NS] == sentinel["host_start_ns"]


def test_records_and_submissions_follow_the_declared_layout():
    from otel_hicache.capture.records import S_ACK_NS, SUBMISSION_FIELDS

    sentinel = {name: f"<{name}>" for name in SUBMISSION_FIELDS}
    handle = submission(**sentinel)
    assert handle == list(sentinel.values()) == submission(*sentinel.values())
    record = TransferRecord(handle)
    assert record.handle is handle
    assert {name: getattr(record, name) for name in SUBMISSION_FIELDS[:S_ACK_NS]} == dict(
        list(sentinel.items())[:S_ACK_NS])  # (the ack time is read from the handle, which ack() stamps)
    assert not hasattr(record, "__dict__")
    assert submission("offload", submit_ns=5) == ["offload", None, 0, 1, None, None, None, None, False, 5,
                                                  None, None, None, None, None, None, None, None, None]
    with pytest.raises(TypeError, match="pagesize"):
        submission("offload", pagesize=64)
    with pytest.raises(TypeError, match="direction"):
        submission("offload", direction="onboard")


def test_a_record_copies_every_submitted_field_from_its_place_in_the_handle():
    """TransferRecord.__init__ spells SUBMISSION_FIELDS out as one unpacking: each name in its place."""
    from otel_hicache.capture.records import S_ACK_NS, SUBMISSION_FIELDS, TransferRecord

    handle = [f"<{name}>" for name in SUBMISSION_FIELDS]
    record = TransferRecord(handle)
    assert record.handle is handle
    for index, name in enumerate(SUBMISSION_FIELDS[:S_ACK_NS]):
        assert getattr(record, name) == handle[index], name
    handle[S_ACK_NS] = 123  # ack() stamps the handle after the record is built: the poller reads it there
    assert record.handle[S_ACK_NS] == 123
