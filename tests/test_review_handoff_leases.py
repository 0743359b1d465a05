"""The hand-off book's expiry scan waits for the soonest lease (HandoffBook._soonest): every way a lease is set
must lower that bound, or a lease runs out unnoticed. (Before this file, the bound's update in begin, layer_sent
and layers_sent could each be removed with no test failing.)"""
import pytest

from servewise.cluster.handoff import HandoffBook, State

WAYS = {
    "begin": lambda book, t, now: None,  # (leased from its begin)
    "layer_sent": lambda book, t, now: book.layer_sent(t.id, 0, now),
    "layers_sent": lambda book, t, now: book.layers_sent(t.id, 2, now),
    "renew": lambda book, t, now: book.renew(t.id, now),
}


@pytest.mark.parametrize("way", WAYS)
def test_a_lease_set_any_way_runs_out_on_time(way):
    book = HandoffBook(lease_s=1.0)
    other = book.begin("other", 4, 0.0, leased=False)
    assert book.expire(0.2) == []  # a scan: the bound is recomputed (nothing leased yet)
    t = book.begin("r", 4, 0.5, leased=way == "begin")
    WAYS[way](book, t, 0.5)
    assert book.expire(1.49) == [] and t.state is not State.EXPIRED
    assert book.expire(1.5) == [t] and t.state is State.EXPIRED and book.live == {other.id}


def test_a_shorter_lease_after_a_longer_one_is_seen():
    book = HandoffBook(lease_s=1.0)
    long = book.begin("long", 4, 0.0)
    assert book.expire(0.5) == []  # the bound is now long's end, 1.0
    book.lease_s = 0.1  # (a server may shorten its leases while running)
    short = book.begin("short", 4, 0.6)
    assert book.expire(0.7) == [short] and book.live == {long.id}
    assert book.expire(0.99) == [] and book.expire(1.0) == [long]  # (the scan at 0.7 kept long's end as the bound)


def test_layers_sent_marks_the_layers_at_once_and_never_goes_back():
    book = HandoffBook(lease_s=1.0)
    t = book.begin("r", 4, 0.0, leased=False)
    book.layers_sent(t.id, 4, 2.0)
    assert (t.state, t.sent_layers, t.lease_until) == (State.SENDING, 4, 3.0)
    book.layers_sent(t.id, 3, 2.5)  # nothing new: the lease is not renewed
    assert (t.sent_layers, t.lease_until) == (4, 3.0)
    book.commit(t.id, 7)
    assert t.state is State.COMMITTED
