"""The hybridserve cache service: heads, leases and ledgers on Redis, plus
the state tier, behind the gRPC contract in proto/cache.proto.

Run it with `python -m cache_service`; talk to it with cache_service.client.CacheClient.
"""
