"""The tier entry framing (export_format.pack_export / unpack_export): bytes pinned, round trip,
and a blob that does not add up is refused."""

from __future__ import annotations

import pytest

from workers.conversation.export_format import ExportedHead, pack_export, unpack_export
from workers.errors import CorruptStateError

EXPORTED = ExportedHead(b"HDR", (("aa", b"12"), ("bb", b"345")))
# u32 little-endian length of the index, the compact JSON index, the header, the chunks
BLOB = b'\x29\x00\x00\x00{"header":3,"chunks":[["aa",2],["bb",3]]}HDR12345'


def test_the_parts_are_the_stated_bytes():
    parts = pack_export(EXPORTED)
    assert parts == [BLOB[:45], b"HDR", b"12", b"345"] and b"".join(parts) == BLOB


def test_round_trip():
    assert unpack_export(b"".join(pack_export(EXPORTED))) == (b"HDR", {"aa": b"12", "bb": b"345"})


@pytest.mark.parametrize("blob", [BLOB + b"x", BLOB[:-1], BLOB[:3], b"\xff\x00\x00\x00{}", BLOB[:4] + b"[" + BLOB[5:]])
def test_a_blob_that_does_not_add_up_is_refused(blob):
    with pytest.raises(CorruptStateError):
        unpack_export(blob)
