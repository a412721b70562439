"""Lua scripts: every check-then-write on Redis runs as one atomic script.

Each script returns a table whose first element is a status word ("OK" or the name
of an error); store.py maps status words to typed errors. Token and version numbers
travel as strings because Lua numbers are doubles.

Fencing: a lease check passes only if the lease key still holds the caller's token.
A missing lease is LEASE_LOST (expired or released); a lease holding a larger token is
STALE_FENCE (someone acquired it after the caller's lease expired). Tokens come from
a per-conversation counter that is never deleted, so they only ever grow.
"""

from __future__ import annotations

HEAD_FIELDS = ("version", "turn", "committed_tokens", "tokens_sha256", "owner",
               "tier_version", "updated_at_ms")

# Appended to every script that needs it (Lua has no imports in EVAL).
_PRELUDE = """
local function head_reply(key)
  return redis.call('HMGET', key, 'version', 'turn', 'committed_tokens', 'tokens_sha256',
                    'owner', 'tier_version', 'updated_at_ms')
end
local function lease_check(lease_key, token)
  local cur = redis.call('HGET', lease_key, 'token')
  if not cur then return 'LEASE_LOST' end
  if cur == token then return nil end
  if tonumber(cur) > tonumber(token) then return 'STALE_FENCE' end
  return 'LEASE_LOST'
end
"""

# KEYS: lease, fence   ARGV: holder, ttl_ms
ACQUIRE = """
local cur = redis.call('HMGET', KEYS[1], 'holder', 'token')
if cur[1] then
  if cur[1] == ARGV[1] then
    -- the same holder retrying (its first reply was lost): same lease, fresh TTL
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {'OK', cur[2], ARGV[2]}
  end
  return {'LEASE_HELD', cur[1], tostring(redis.call('PTTL', KEYS[1]))}
end
local token = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'token', token)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'OK', tostring(token), ARGV[2]}
"""

# KEYS: lease   ARGV: token, ttl_ms
RENEW = _PRELUDE + """
local err = lease_check(KEYS[1], ARGV[1])
if err then return {err} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'OK', redis.call('HGET', KEYS[1], 'holder')}
"""

# KEYS: lease   ARGV: token
# Releasing a lease that is already gone succeeds: a retried release must not fail.
RELEASE = _PRELUDE + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'OK'} end
local err = lease_check(KEYS[1], ARGV[1])
if err then return {err} end
redis.call('DEL', KEYS[1])
return {'OK'}
"""

# KEYS: head, lease, ledger
# ARGV: token, expected_version, ledger_entry, committed_tokens, tokens_sha256, owner,
#       now_ms, release(0/1), publish_id, new_token_count
PUBLISH = _PRELUDE + """
local head = redis.call('HMGET', KEYS[1], 'version', 'committed_tokens', 'publish_id')
local version = tonumber(head[1] or '0')
if head[3] == ARGV[9] and version == tonumber(ARGV[2]) + 1 then
  -- a retried publish whose first reply was lost: answer it, do not redo it
  return {'OK', head_reply(KEYS[1])}
end
local err = lease_check(KEYS[2], ARGV[1])
if err then return {err} end
if version ~= tonumber(ARGV[2]) then return {'VERSION_CONFLICT', tostring(version)} end
local committed = tonumber(head[2] or '0')
if committed + tonumber(ARGV[10]) ~= tonumber(ARGV[4]) then
  return {'BAD_TOKEN_COUNT', tostring(committed)}
end
local turn = redis.call('RPUSH', KEYS[3], ARGV[3])
redis.call('HSET', KEYS[1], 'version', version + 1, 'turn', turn,
           'committed_tokens', ARGV[4], 'tokens_sha256', ARGV[5], 'owner', ARGV[6],
           'updated_at_ms', ARGV[7], 'publish_id', ARGV[9])
if redis.call('HEXISTS', KEYS[1], 'tier_version') == 0 then
  redis.call('HSET', KEYS[1], 'tier_version', 0)
end
if ARGV[8] == '1' then redis.call('DEL', KEYS[2]) end
return {'OK', head_reply(KEYS[1])}
"""

# KEYS: head, lease   ARGV: token
DISCARD = _PRELUDE + """
local err = lease_check(KEYS[2], ARGV[1])
if err then return {err} end
redis.call('DEL', KEYS[2])
return {'OK', head_reply(KEYS[1])}
"""

# KEYS: head, lease   ARGV: token, expected_version, new_owner, now_ms
TRANSFER = _PRELUDE + """
local err = lease_check(KEYS[2], ARGV[1])
if err then return {err} end
local version = redis.call('HGET', KEYS[1], 'version')
if not version then return {'NOT_FOUND'} end
if version ~= ARGV[2] then return {'VERSION_CONFLICT', version} end
redis.call('HSET', KEYS[1], 'owner', ARGV[3], 'updated_at_ms', ARGV[4])
return {'OK', head_reply(KEYS[1])}
"""

# KEYS: head   ARGV: version, now_ms
# The tier only accepts the state of the current head version; tier_version never
# moves backwards (an old put arriving late must not hide a newer entry).
MARK_TIER = _PRELUDE + """
local version = redis.call('HGET', KEYS[1], 'version')
if not version then return {'NOT_FOUND'} end
if version ~= ARGV[1] then return {'VERSION_CONFLICT', version} end
if tonumber(redis.call('HGET', KEYS[1], 'tier_version') or '0') < tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'tier_version', ARGV[1], 'updated_at_ms', ARGV[2])
end
return {'OK', head_reply(KEYS[1])}
"""

# KEYS: replica, epoch counter, replica set
# ARGV: replica_id, address, ttl_ms, now_ms
REGISTER = """
local epoch = redis.call('INCR', KEYS[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'replica_id', ARGV[1], 'address', ARGV[2], 'epoch', epoch,
           'running_requests', 0, 'free_kv_blocks', 0, 'last_seen_ms', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[1])
return {'OK', tostring(epoch)}
"""

# KEYS: replica   ARGV: epoch, ttl_ms, now_ms, running_requests, free_kv_blocks
HEARTBEAT = """
local epoch = redis.call('HGET', KEYS[1], 'epoch')
if not epoch then return {'NOT_FOUND'} end
if epoch ~= ARGV[1] then return {'NOT_FOUND', epoch} end
redis.call('HSET', KEYS[1], 'running_requests', ARGV[4], 'free_kv_blocks', ARGV[5],
           'last_seen_ms', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'OK', redis.call('HMGET', KEYS[1], 'replica_id', 'address', 'epoch',
                         'running_requests', 'free_kv_blocks', 'last_seen_ms')}
"""

# KEYS: replica set   ARGV: replica key prefix
# Liveness is the replica key's TTL; ids whose key expired are pruned from the set.
LIST_REPLICAS = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local fields = redis.call('HMGET', ARGV[1] .. id, 'replica_id', 'address', 'epoch',
                            'running_requests', 'free_kv_blocks', 'last_seen_ms')
  if fields[1] then
    table.insert(out, fields)
  else
    redis.call('SREM', KEYS[1], id)
  end
end
return out
"""
