"""vramd.image.supply: the streamed restore's supply messages, encoded and checked (pure functions)."""
import pytest

from vramd.image.supply import MESSAGE_SIZE, SupplyDecoder, SupplyError, encode


def test_advances_come_out_once_each_and_partial_messages_wait_for_their_rest() -> None:
    d = SupplyDecoder([100, 200])
    data = encode(0, 10) + encode(1, 50) + encode(0, 10) + encode(0, 100)
    out = list(d.feed(data[:MESSAGE_SIZE + 3]))
    assert out == [(0, 10)]
    assert list(d.feed(data[MESSAGE_SIZE + 3:])) == [(1, 50), (0, 100)]
    assert d.ends == [100, 50]
    d.finish()


@pytest.mark.parametrize("msg, words", [
    (encode(2, 1), "data file #2: the image has 2"),
    (encode(0, 101), "past its length"),
    (bytes(4) + b"\x01" + bytes(11), "reserved field"),
])
def test_a_message_no_client_sends_is_refused(msg: bytes, words: str) -> None:
    with pytest.raises(SupplyError, match=words):
        list(SupplyDecoder([100, 200]).feed(msg))


def test_an_end_never_goes_back_and_a_cut_message_is_refused_at_the_end() -> None:
    d = SupplyDecoder([100])
    list(d.feed(encode(0, 50)))
    with pytest.raises(SupplyError, match="goes back"):
        list(d.feed(encode(0, 40)))
    d = SupplyDecoder([100])
    list(d.feed(encode(0, 50)[:5]))
    with pytest.raises(SupplyError, match="inside a message"):
        d.finish()


def test_a_bad_message_is_numbered_from_the_pipes_start() -> None:
    d = SupplyDecoder([100])
    list(d.feed(encode(0, 10) + encode(0, 20)))
    with pytest.raises(SupplyError, match=r"supply message #3: reserved field 0x1 is not 0"):
        list(d.feed(encode(0, 30)[:4] + b"\x01" + bytes(11)))
