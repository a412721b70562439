"""The checked-in generated modules are exactly what grpc_tools makes of cache.proto."""

from proto.generate import GENERATED, REPO_ROOT, generate


def test_generated_modules_match_the_proto(tmp_path):
    outputs = generate(tmp_path)
    assert [p.name for p in outputs] == list(GENERATED)
    for fresh in outputs:
        checked_in = REPO_ROOT / "proto" / fresh.name
        assert checked_in.read_bytes() == fresh.read_bytes(), \
            f"{checked_in.name} is stale: run `python -m proto.generate`"
