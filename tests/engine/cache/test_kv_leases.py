"""A producer's lease words (engine.cache.kv_leases): a lease's word holds its epoch while the lease is open
and is zeroed when it ends; epochs are never repeated; a full table lends nothing."""

from __future__ import annotations

import ctypes

from engine.cache.kv_leases import KVLeaseTable


def word_at(address: int) -> int:
    """What a consumer's READ of the lease's 8 bytes would see."""
    return ctypes.c_uint64.from_address(address).value


def test_a_lease_s_word_holds_its_epoch_until_the_lease_ends():
    table = KVLeaseTable(slots=4)
    lease = table.open("a")
    assert lease.epoch and word_at(lease.address) == lease.epoch
    assert table.open("a") == lease                       # the same request: the same lease
    table.close("a")
    assert word_at(lease.address) == 0 and table.open_count == 0
    table.close("a")                                      # ends once; unknown ids are ignored
    again = table.open("b")                               # the slot comes back with a new epoch
    assert again.address == lease.address and again.epoch != lease.epoch
    assert word_at(again.address) == again.epoch


def test_a_full_table_opens_no_lease_and_addresses_lie_inside_its_region():
    table = KVLeaseTable(slots=2)
    leases = [table.open("a"), table.open("b")]
    assert table.open("c") is None
    base, size = table.region
    assert all(base <= lease.address < base + size for lease in leases)
    assert len({lease.epoch for lease in leases}) == 2
