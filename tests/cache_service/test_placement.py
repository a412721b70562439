"""Rendezvous placement on its own: spread, stability, ~1/N movement, and the target syntax."""

import collections
import socket

import pytest

from cache_service.placement import Targets, addresses_of, parse_targets, rank

INSTANCES = [f"10.0.0.{i}:50051" for i in range(1, 5)]
KEYS = [f"{i:032x}" for i in range(20_000)]


def owners(instances):
    return {key: rank(key, instances)[0] for key in KEYS}


def test_entries_spread_evenly_over_the_instances():
    counts = collections.Counter(owners(INSTANCES).values())
    expected = len(KEYS) / len(INSTANCES)
    assert set(counts) == set(INSTANCES)
    assert all(abs(n - expected) < 0.05 * expected for n in counts.values()), counts


def test_a_keys_order_is_stable_and_independent_of_how_the_list_is_given():
    for key in KEYS[:200]:
        assert rank(key, INSTANCES) == rank(key, list(reversed(INSTANCES))) == rank(key, INSTANCES)


def test_removing_an_instance_moves_only_its_keys_to_their_second_choice():
    before = {key: rank(key, INSTANCES) for key in KEYS}
    gone = INSTANCES[2]
    after = owners([i for i in INSTANCES if i != gone])
    moved = [key for key in KEYS if after[key] != before[key][0]]
    assert all(before[key][0] == gone for key in moved)
    assert all(after[key] == before[key][1] for key in moved)  # where its copy was
    assert abs(len(moved) / len(KEYS) - 1 / 4) < 0.02


def test_adding_an_instance_takes_about_one_nth_of_the_keys_from_the_others():
    before = owners(INSTANCES)
    new = "10.0.0.9:50051"
    after = owners([*INSTANCES, new])
    moved = [key for key in KEYS if after[key] != before[key]]
    assert all(after[key] == new for key in moved)
    assert abs(len(moved) / len(KEYS) - 1 / 5) < 0.02


@pytest.mark.parametrize("spec, expected", [
    ("cache:50051", Targets(("cache:50051",))),
    (" a:1, b:2 ,a:1", Targets(("a:1", "b:2"))),
    ("dns:///peers.ns.svc:50051,c:3", Targets(("c:3",), (("peers.ns.svc", 50051),))),
    ("[::1]:50051", Targets(("[::1]:50051",))),
])
def test_targets_parse(spec, expected):
    assert parse_targets(spec) == expected


def test_only_one_plain_address_is_a_single_instance():
    assert parse_targets("cache:50051").single
    assert not parse_targets("a:1,b:2").single
    assert not parse_targets("dns:///peers:50051").single


@pytest.mark.parametrize("spec", ["", " , ", "cache", "cache:port", "dns:///peers", "a:70000"])
def test_malformed_targets_are_refused(spec):
    with pytest.raises(ValueError):
        parse_targets(spec)


def test_a_name_that_resolves_to_several_addresses_is_several_instances():
    infos = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.0.7", 50051)),
             (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.0.8", 50051)),
             (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.0.7", 50051)),
             (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::3", 50051, 0, 0))]
    assert addresses_of(infos, 50051) == ["10.1.0.7:50051", "10.1.0.8:50051", "[fd00::3]:50051"]
