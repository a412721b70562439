"""Lua scripts: every check-then-write on Redis runs as one atomic script.

Each script returns a table whose first element is a status word ("OK" or the name
of an error); store.py maps status words to typed errors. Token and version numbers
travel as strings because Lua numbers are doubles.

Every script on the turn path is O(1) in the size of the conversation (ledger appends
are RPUSH; rewind and fork, which copy or trim turns, are not on the turn path).

Retention: a conversation's head, ledger and marks expire `conversation ttl` after its last
turn. Every script that writes them sets their TTL in the same atomic step (`keep`), so no
key of a conversation is ever left without one; an acquire or a renew extends them to the
conversation TTL + the lease's, so a conversation never expires under a live lease. A TTL of
'0' means never (PERSIST). Reads never refresh: they must not write (under a full Redis they
go on) and a poller must not keep storage alive.

Memory: Redis refuses a script's first write that may grow memory (a "denyoom" command such as
HSET, RPUSH, HINCRBY) while it is over `maxmemory`, and lets the rest of the script run once a
first write passed. So every script that grows memory writes a denyoom command first (never a
PEXPIRE or DEL, which would let it grow past the limit): over the limit it fails before it
changed anything (store.py: STORAGE_FULL).

Fencing: the caller's (token, incarnation) has already passed its proof check
(leases.py). A lease check passes only if the lease key holds exactly that token and
incarnation. A missing lease or another incarnation is LEASE_LOST; a larger token of
the same incarnation is STALE_FENCE (someone acquired it after the caller's lease
expired). Tokens come from the conversation's fence hash (incarnation + counter); it
outlives every lease by the fence retention and is deleted with the conversation, so
it is bounded, and a new incarnation makes every older proof worthless.
"""

from __future__ import annotations

HEAD_FIELDS = ("version", "turn", "committed_tokens", "tokens_sha256", "owner",
               "tier_version", "updated_at_ms", "incarnation")

# sha256 of no tokens: the head of a conversation rewound to turn 0.
EMPTY_TOKENS_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

# Prepended to every script that needs it (Lua has no imports in EVAL).
_PRELUDE = """
local function head_reply(key)
  return redis.call('HMGET', key, 'version', 'turn', 'committed_tokens', 'tokens_sha256',
                    'owner', 'tier_version', 'updated_at_ms', 'incarnation')
end
local function keep(ttl_ms, ...)
  for _, key in ipairs({...}) do
    if ttl_ms == '0' then redis.call('PERSIST', key) else redis.call('PEXPIRE', key, ttl_ms) end
  end
end
local function lease_check(lease_key, token, incarnation)
  local cur = redis.call('HMGET', lease_key, 'token', 'incarnation')
  if not cur[1] or cur[2] ~= incarnation then return 'LEASE_LOST' end
  if cur[1] == token then return nil end
  if tonumber(cur[1]) > tonumber(token) then return 'STALE_FENCE' end
  return 'LEASE_LOST'
end
"""

# KEYS: lease, fence, head, ledger, marks
# ARGV: holder, ttl_ms, attempt (sha256 hex of the attempt key, '' = none),
#       new incarnation (used if the fence has none), fence ttl_ms,
#       conversation ttl_ms while leased ('0' = never expires)
# Reply: OK, token, incarnation, ttl_ms, head fields | LEASE_HELD, pttl
ACQUIRE = _PRELUDE + """
local cur = redis.call('HMGET', KEYS[1], 'holder', 'token', 'attempt', 'incarnation')
if cur[1] then
  if ARGV[3] ~= '' and cur[3] == ARGV[3] and cur[1] == ARGV[1] then
    -- the same attempt retrying (its first reply was lost): same lease, fresh TTL
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    redis.call('PEXPIRE', KEYS[2], ARGV[5])
    keep(ARGV[6], KEYS[3], KEYS[4], KEYS[5])
    return {'OK', cur[2], cur[4], ARGV[2], head_reply(KEYS[3])}
  end
  return {'LEASE_HELD', tostring(redis.call('PTTL', KEYS[1]))}
end
local incarnation = redis.call('HGET', KEYS[2], 'incarnation')
if not incarnation then
  incarnation = ARGV[4]
  redis.call('HSET', KEYS[2], 'incarnation', incarnation)
end
local token = redis.call('HINCRBY', KEYS[2], 'next', 1)
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'token', token, 'attempt', ARGV[3],
           'incarnation', incarnation)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
keep(ARGV[6], KEYS[3], KEYS[4], KEYS[5])
return {'OK', tostring(token), incarnation, ARGV[2], head_reply(KEYS[3])}
"""

# KEYS: lease, fence, head, ledger, marks
# ARGV: token, incarnation, ttl_ms, fence ttl_ms, conversation ttl_ms while leased
# Only PEXPIREs: a renewal never needs memory, so it goes on while Redis is full.
RENEW = _PRELUDE + """
local err = lease_check(KEYS[1], ARGV[1], ARGV[2])
if err then return {err} end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
keep(ARGV[5], KEYS[3], KEYS[4], KEYS[5])
return {'OK', redis.call('HGET', KEYS[1], 'holder')}
"""

# KEYS: lease   ARGV: token, incarnation
# Releasing a lease that is already gone succeeds: a retried release must not fail.
RELEASE = _PRELUDE + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'OK'} end
local err = lease_check(KEYS[1], ARGV[1], ARGV[2])
if err then return {err} end
redis.call('DEL', KEYS[1])
return {'OK'}
"""

# KEYS: head, lease, ledger, marks
# ARGV: token, incarnation, expected_version, ledger_entry, committed_tokens, tokens_sha256,
#       owner, now_ms, release(0/1), publish_id, new_token_count, request digest,
#       new head incarnation (used on the first publish), conversation ttl_ms
# marks: one "committed_tokens tokens_sha256 entry_bytes" per turn: a rewind or fork learns
# the head at turn k from it, a ledger read plans its page by bytes without loading turns.
PUBLISH = _PRELUDE + """
local head = redis.call('HMGET', KEYS[1], 'version', 'committed_tokens', 'publish_id',
                        'publish_digest', 'publish_fence')
local version = tonumber(head[1] or '0')
local fence = ARGV[2] .. ':' .. ARGV[1]
if head[3] == ARGV[10] and version == tonumber(ARGV[3]) + 1 then
  -- a retry whose first reply was lost: answered only if it is the same request from
  -- the same lease; anything else reusing the publish_id is a conflict
  if head[4] == ARGV[12] and head[5] == fence then
    -- refreshed as the first attempt did. PEXPIRE always replicates (PERSIST of a key without a
    -- TTL would not), so a WAIT after this retry also covers the first attempt's write.
    redis.call('PEXPIRE', KEYS[1], 86400000)
    keep(ARGV[14], KEYS[1], KEYS[3], KEYS[4])
    return {'OK', head_reply(KEYS[1])}
  end
  return {'VERSION_CONFLICT', tostring(version)}
end
local err = lease_check(KEYS[2], ARGV[1], ARGV[2])
if err then return {err} end
if version ~= tonumber(ARGV[3]) then return {'VERSION_CONFLICT', tostring(version)} end
local committed = tonumber(head[2] or '0')
if committed + tonumber(ARGV[11]) ~= tonumber(ARGV[5]) then
  return {'BAD_TOKEN_COUNT', tostring(committed)}
end
local turn = redis.call('RPUSH', KEYS[3], ARGV[4])
redis.call('RPUSH', KEYS[4], ARGV[5] .. ' ' .. ARGV[6] .. ' ' .. #ARGV[4])
redis.call('HSET', KEYS[1], 'version', version + 1, 'turn', turn,
           'committed_tokens', ARGV[5], 'tokens_sha256', ARGV[6], 'owner', ARGV[7],
           'updated_at_ms', ARGV[8], 'publish_id', ARGV[10], 'publish_digest', ARGV[12],
           'publish_fence', fence)
redis.call('HSETNX', KEYS[1], 'tier_version', 0)
redis.call('HSETNX', KEYS[1], 'incarnation', ARGV[13])
keep(ARGV[14], KEYS[1], KEYS[3], KEYS[4])
if ARGV[9] == '1' then redis.call('DEL', KEYS[2]) end
return {'OK', head_reply(KEYS[1])}
"""

# KEYS: head, lease   ARGV: token, incarnation
DISCARD = _PRELUDE + """
local err = lease_check(KEYS[2], ARGV[1], ARGV[2])
if err then return {err} end
redis.call('DEL', KEYS[2])
return {'OK', head_reply(KEYS[1])}
"""

# KEYS: head, lease   ARGV: token, incarnation, expected_version, new_owner, now_ms
TRANSFER = _PRELUDE + """
local err = lease_check(KEYS[2], ARGV[1], ARGV[2])
if err then return {err} end
local version = redis.call('HGET', KEYS[1], 'version')
if not version then return {'NOT_FOUND'} end
if version ~= ARGV[3] then return {'VERSION_CONFLICT', version} end
redis.call('HSET', KEYS[1], 'owner', ARGV[4], 'updated_at_ms', ARGV[5])
return {'OK', head_reply(KEYS[1])}
"""

# KEYS: head, lease, ledger, marks
# ARGV: token, incarnation, expected_version, turn, owner, now_ms, empty tokens sha256,
#       conversation ttl_ms
# The head keeps its incarnation and its version moves forward: a worker holding the
# old version's state sees a new version and cannot mistake it for its own.
REWIND = _PRELUDE + """
local err = lease_check(KEYS[2], ARGV[1], ARGV[2])
if err then return {err} end
local version = redis.call('HGET', KEYS[1], 'version')
if not version then return {'NOT_FOUND'} end
if version ~= ARGV[3] then return {'VERSION_CONFLICT', version} end
local turns = redis.call('LLEN', KEYS[3])
local k = tonumber(ARGV[4])
if k > turns then return {'BAD_TURN', tostring(turns)} end
local committed, sha = '0', ARGV[7]
if k == 0 then
  redis.call('DEL', KEYS[3], KEYS[4])
else
  redis.call('LTRIM', KEYS[3], 0, k - 1)
  redis.call('LTRIM', KEYS[4], 0, k - 1)
  local mark = redis.call('LINDEX', KEYS[4], k - 1)
  committed, sha = string.match(mark, '^(%d+) (%x+)')
end
redis.call('HSET', KEYS[1], 'version', tonumber(version) + 1, 'turn', k,
           'committed_tokens', committed, 'tokens_sha256', sha, 'owner', ARGV[5],
           'tier_version', 0, 'updated_at_ms', ARGV[6], 'publish_id', '',
           'publish_digest', '', 'publish_fence', '')
keep(ARGV[8], KEYS[1], KEYS[3], KEYS[4])
return {'OK', head_reply(KEYS[1])}
"""

# KEYS: source head, source ledger, source marks, target head, target ledger, target marks
# ARGV: turn, expected source version ('0' = any), now_ms, new incarnation, empty sha256,
#       conversation ttl_ms (of the fork; the source is only read, so not refreshed)
# Touches two conversations: on a Redis Cluster, where they sit on two slots, FORK_SOURCE and
# FORK_TARGET below do it instead (store.py); copies in batches so Lua never holds the whole ledger at once. The target's
# head is written first: its HSET is the write Redis refuses when full, before anything moved.
FORK = _PRELUDE + """
local version = redis.call('HGET', KEYS[1], 'version')
if not version then return {'NOT_FOUND'} end
if ARGV[2] ~= '0' and version ~= ARGV[2] then return {'VERSION_CONFLICT', version} end
if redis.call('EXISTS', KEYS[4]) == 1 then return {'ALREADY_EXISTS'} end
local k = tonumber(ARGV[1])
local turns = redis.call('LLEN', KEYS[2])
if k > turns then return {'BAD_TURN', tostring(turns)} end
local committed, sha = '0', ARGV[5]
if k > 0 then
  local mark = redis.call('LINDEX', KEYS[3], k - 1)
  committed, sha = string.match(mark, '^(%d+) (%x+)')
end
redis.call('HSET', KEYS[4], 'version', 1, 'turn', k, 'committed_tokens', committed,
           'tokens_sha256', sha, 'owner', '', 'tier_version', 0, 'updated_at_ms', ARGV[3],
           'incarnation', ARGV[4])
redis.call('DEL', KEYS[5], KEYS[6])
local batch = 64
for first = 0, k - 1, batch do
  local last = math.min(first + batch, k) - 1
  redis.call('RPUSH', KEYS[5], unpack(redis.call('LRANGE', KEYS[2], first, last)))
  redis.call('RPUSH', KEYS[6], unpack(redis.call('LRANGE', KEYS[3], first, last)))
end
keep(ARGV[6], KEYS[4], KEYS[5], KEYS[6])
return {'OK', head_reply(KEYS[4])}
"""

# On a Redis Cluster the two conversations of a fork sit on two slots, which no one script may
# touch: there the fork reads the source (one script, a consistent snapshot at the expected
# version) and writes the target (another, all or nothing). The source may move on in between;
# the fork is then a copy of it as it was, which a fork at an earlier moment would also have been.

# KEYS: source head, ledger, marks   ARGV: turn, expected source version ('0' = any)
# Reply: OK, committed tokens, tokens sha256, {entries}, {marks}   (turns 1..turn)
FORK_SOURCE = _PRELUDE + """
local version = redis.call('HGET', KEYS[1], 'version')
if not version then return {'NOT_FOUND'} end
if ARGV[2] ~= '0' and version ~= ARGV[2] then return {'VERSION_CONFLICT', version} end
local k = tonumber(ARGV[1])
local turns = redis.call('LLEN', KEYS[2])
if k > turns then return {'BAD_TURN', tostring(turns)} end
local committed, sha = '0', ''
if k > 0 then
  committed, sha = string.match(redis.call('LINDEX', KEYS[3], k - 1), '^(%d+) (%x+)')
end
return {'OK', committed, sha, redis.call('LRANGE', KEYS[2], 0, k - 1), redis.call('LRANGE', KEYS[3], 0, k - 1)}
"""

# KEYS: target head, ledger, marks
# ARGV: now_ms, new incarnation, conversation ttl_ms, turns k, committed tokens, tokens sha256,
#       then k ledger entries, then k marks
FORK_TARGET = _PRELUDE + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {'ALREADY_EXISTS'} end
local k = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'version', 1, 'turn', k, 'committed_tokens', ARGV[5],
           'tokens_sha256', ARGV[6], 'owner', '', 'tier_version', 0, 'updated_at_ms', ARGV[1],
           'incarnation', ARGV[2])
redis.call('DEL', KEYS[2], KEYS[3])
local batch = 64
for first = 0, k - 1, batch do
  local last = math.min(first + batch, k) - 1
  redis.call('RPUSH', KEYS[2], unpack(ARGV, 7 + first, 7 + last))
  redis.call('RPUSH', KEYS[3], unpack(ARGV, 7 + k + first, 7 + k + last))
end
keep(ARGV[3], KEYS[1], KEYS[2], KEYS[3])
return {'OK', head_reply(KEYS[1])}
"""

# KEYS: head, ledger, marks   ARGV: first turn (0-based), max turns, page bytes
# Reply: head fields, next turn (1-based, '0' = end), entries. The page is planned on
# the marks' entry sizes, so Redis loads only the turns it returns; the first turn is
# returned even if it alone exceeds the page size (a turn is bounded on publish).
#
#   turn (1-based)      1     2     3     4     5
#   list index          0     1     2     3     4
#   from_turn = 2  ->  first = 1;  the page fits turns 2..3  ->  count = 2
#                      next turn = first + count + 1 = 4   ('0' once first + count = LLEN)
READ_LEDGER = _PRELUDE + """
local head = head_reply(KEYS[1])
if not head[1] then return {head, '0', {}} end
local first, page = tonumber(ARGV[1]), tonumber(ARGV[3])
local size, count = 0, 0
for _, mark in ipairs(redis.call('LRANGE', KEYS[3], first, first + tonumber(ARGV[2]) - 1)) do
  local bytes = tonumber(string.match(mark, '(%d+)$'))
  if count > 0 and size + bytes > page then break end
  size, count = size + bytes, count + 1
end
local entries = {}
if count > 0 then entries = redis.call('LRANGE', KEYS[2], first, first + count - 1) end
local nxt = '0'
if first + count < redis.call('LLEN', KEYS[2]) then nxt = tostring(first + count + 1) end
return {head, nxt, entries}
"""

# KEYS: head, lease   ARGV: version, incarnation, now_ms, lease token ('' = unfenced),
#                          lease incarnation
# The tier only accepts the state of the current head version of the same incarnation
# (a put for a deleted and re-created conversation names the old one), and, for a put
# that names a lease, only while that lease is live; tier_version never moves
# backwards (an old put arriving late must not hide a newer entry).
MARK_TIER = _PRELUDE + """
if ARGV[4] ~= '' then
  local err = lease_check(KEYS[2], ARGV[4], ARGV[5])
  if err then return {err} end
end
local head = redis.call('HMGET', KEYS[1], 'version', 'incarnation')
if not head[1] then return {'NOT_FOUND'} end
if head[1] ~= ARGV[1] or head[2] ~= ARGV[2] then return {'VERSION_CONFLICT', head[1]} end
if tonumber(redis.call('HGET', KEYS[1], 'tier_version') or '0') < tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'tier_version', ARGV[1], 'updated_at_ms', ARGV[3])
end
return {'OK', head_reply(KEYS[1])}
"""

# KEYS: fence, head, lease, ledger, marks   (delete: everything, the fence included)
DELETE = """
return redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[1])
"""

# -- the prefix index (keys.PrefixKeys); hints, so no fencing -------------------------------

# A name's hash: field replica -> "tokens:expires_ms". Each replica's entry expires on its own
# (the key's TTL is only the latest of them): another replica announcing the same name must not
# keep a dead replica's entry alive. Entries written before expiries were kept ("tokens") count
# as live until their key expires.

# KEYS: live, then one name key per entry
# ARGV: replica, now_ms, ttl_ms, then (name, tokens) per entry
# Names expired since the last announce leave the live set here, so it stays bounded by the
# live names plus those expired since; entries of other replicas past their expiry leave the
# hashes announced to, so a hash holds the replicas that announced it within the TTL.
ANNOUNCE_PREFIXES = """
local replica, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local expires = now + ttl
for i = 2, #KEYS do
  redis.call('HSET', KEYS[i], replica, ARGV[2 * i + 1] .. ':' .. expires)
  local fields = redis.call('HGETALL', KEYS[i])
  for j = 1, #fields, 2 do
    local at = string.find(fields[j + 1], ':', 1, true)
    if at and tonumber(string.sub(fields[j + 1], at + 1)) <= now then
      redis.call('HDEL', KEYS[i], fields[j])
    end
  end
  redis.call('PEXPIRE', KEYS[i], ttl)
  redis.call('ZADD', KEYS[1], expires, ARGV[2 * i])
end
-- after the HSETs (the first write must be the one a full Redis refuses); the entries just
-- added score now + ttl, so they stay
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return {'OK'}
"""

# KEYS: live, then one name key per name   ARGV: replica, then the names
FORGET_PREFIXES = """
for i = 2, #KEYS do
  if redis.call('HDEL', KEYS[i], ARGV[1]) == 1 and redis.call('EXISTS', KEYS[i]) == 0 then
    redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return {'OK'}
"""

# KEYS: the name keys of a chat's prefixes, shortest first   ARGV: now_ms
# Reply: {index (0-based, -1 = none), {replica, tokens, ...}}: each replica with a live entry for
# one of the names, with the tokens of its longest; index: the longest name anyone holds. Read
# from the longest down to the shortest: a replica that died (or forgot) holding a long prefix
# must not hide another holding a shorter one.
FIND_PREFIX = """
local now = tonumber(ARGV[1])
local seen, found, index = {}, {}, -1
for i = #KEYS, 1, -1 do
  local holders = redis.call('HGETALL', KEYS[i])
  for j = 1, #holders, 2 do
    local replica, value = holders[j], holders[j + 1]
    local at = string.find(value, ':', 1, true)
    if not seen[replica] and (not at or tonumber(string.sub(value, at + 1)) > now) then
      seen[replica] = true
      if index < 0 then index = i - 1 end
      found[#found + 1] = replica
      found[#found + 1] = at and string.sub(value, 1, at - 1) or value
      found[#found + 1] = i - 1
    end
  end
end
return {index, found}
"""
