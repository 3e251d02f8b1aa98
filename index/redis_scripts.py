"""The Lua scripts `RedisIndex` and `RedisSessionStore` run server-side (index/redis.py).

Needs Redis >= 5 (scripts replicated by their effects, so TIME may precede writes).
Every script touches keys of ONE hash tag only (Redis Cluster runs a script on one
shard). A script may build key names from the prefix it is given in KEYS[1]: Redis
allows undeclared keys as long as they hash to the slot of the declared ones, and the
shared ``{tag}`` guarantees that.

Key layout (``p`` is the deployment's key prefix, ``ns`` a namespace digest in hex):

    {p:reg}:nodes          hash node_id → "num epoch seen_ms"   the registry
    {p:reg}:next           counter, the last node number handed out
    {p:reg}:lease:<node>   msgpack [grpc, transport, kind], PX = the lease TTL
    {p:reg}:spaces         set of namespaces ever published (for sweep)
    {p:ns}:holders         hash num → epoch of that node's block map here
    {p:ns}:m:<num>         hash block hash (16 raw bytes) → tier mask (bit = TierKind.rank)
    p:s:<session>          hash node, moves; PX = the affinity TTL
    p:moves                list of msgpack move records, newest first, capped

`RedisBoundary` sends them: EVALSHA, falling back to EVAL when the server answers NOSCRIPT
(a restarted or flushed Redis), pipelines for batches, and the translation of every Redis
error into ``IndexUnavailable`` at this edge.

A node's block map belongs to one epoch (``holders``); an entry of an older epoch, of a
node whose lease was gone when the caller looked, or of a node number the registry no
longer knows is garbage: `MATCH` unlinks such maps whole (UNLINK frees in the background).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import ssl
from collections.abc import Iterator, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AuthenticationError, NoScriptError, RedisError

from kvstore.errors import IndexUnavailable, InvalidArgument

__all__ = ["RedisBoundary", "RedisClient", "REGISTER", "VIEW", "APPLY", "MATCH", "MATCH_STRIDE", "SESSION_PUT", "SESSION_REASSIGN"]

RedisClient = aioredis.Redis | RedisCluster
ScriptCall = tuple[str, Sequence[str], Sequence[Any]]  # source, keys, args


class RedisBoundary:
    """A client and everything that crosses it. ``num_round_trips`` counts requests sent
    (a pipeline counts once), so that benchmarks and tests can hold the index to its budget."""

    def __init__(self, client: RedisClient, where: str, owns_client: bool) -> None:
        self.client = client
        self.where = where.split("@")[-1]  # never echo a password
        self.owns_client = owns_client
        self.num_round_trips = 0

    @contextlib.contextmanager
    def translated(self, what: str) -> Iterator[None]:
        try:
            yield
        except (RedisError, OSError) as exc:
            raise IndexUnavailable(
                f"the Redis index at {self.where} failed during {what} ({type(exc).__name__}: {exc}); "
                "this node keeps serving its own blocks, and should re-register and re-publish its "
                "catalogue once Redis answers again."
            ) from exc

    async def check_access(self) -> None:
        """One PING. Credentials or certificates that Redis refuses, or a server certificate
        this side does not trust, are InvalidArgument: settings that no retry can fix. A
        Redis that cannot be reached is IndexUnavailable."""
        with self.translated("a first contact"):
            try:
                await self.command("PING")
            except AuthenticationError as exc:
                raise InvalidArgument(
                    f"the Redis index at {self.where} refused this node's credentials ({exc}); check index.username "
                    "and index.password (or KVSTORE_INDEX_PASSWORD) against the Redis ACL user."
                ) from exc
            except (RedisError, OSError) as exc:
                handshake = _tls_failure(exc)
                if handshake is None:
                    raise  # an outage, not a setting: translated below
                raise self.tls_refused(handshake) from exc

    def tls_refused(self, handshake: ssl.SSLError) -> InvalidArgument:
        return InvalidArgument(
            f"the TLS handshake with the Redis index at {self.where} failed ({handshake}); check that index.tls_ca "
            "is the CA that signed Redis's certificate, and that index.tls_cert and index.tls_key are a client "
            "certificate and key of a CA that Redis trusts (its tls-ca-cert-file)."
        )

    async def command(self, *args: Any) -> Any:
        self.num_round_trips += 1
        return await self.client.execute_command(*args)

    async def run(self, source: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        self.num_round_trips += 1
        try:
            return await self.client.evalsha(_sha(source), len(keys), *keys, *args)
        except NoScriptError:
            self.num_round_trips += 1
            return await self.client.eval(source, len(keys), *keys, *args)

    async def run_many(self, calls: list[ScriptCall], extra: Sequence[tuple] = ()) -> list[Any]:
        """One pipeline: every script call, then the plain ``extra`` commands. Calls that met
        NOSCRIPT run again, in their order, as EVAL (all calls of a namespace go to one
        shard, which either has the script or not, so their order holds)."""
        pipe = self._pipeline()
        for source, keys, args in calls:
            # ClusterPipeline blocks its evalsha() method, not the command itself
            pipe.execute_command("EVALSHA", _sha(source), len(keys), *keys, *args)
        for command in extra:
            pipe.execute_command(*command)
        self.num_round_trips += 1
        results = await pipe.execute(raise_on_error=False)
        missing = [i for i, result in enumerate(results[: len(calls)]) if isinstance(result, NoScriptError)]
        if missing:
            pipe = self._pipeline()
            for i in missing:
                source, keys, args = calls[i]
                pipe.execute_command("EVAL", source, len(keys), *keys, *args)
            self.num_round_trips += 1
            for i, result in zip(missing, await pipe.execute(raise_on_error=False)):
                results[i] = result
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    async def close(self) -> None:
        if self.owns_client:
            await self.client.aclose()

    def _pipeline(self) -> Any:
        return self.client.pipeline(transaction=False) if isinstance(self.client, aioredis.Redis) else self.client.pipeline()


def _tls_failure(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error under a Redis or OS error, if the handshake is what failed."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@functools.cache
def _sha(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()


# KEYS: nodes, next, lease.  ARGV: node_id, ttl_ms, info, force_new_epoch ("1"/"0").
# A lease that is missing (expired, left, Redis restarted) or a new process starts a new
# epoch; epochs are max(previous + 1, Redis time in ms) so that they keep growing even
# when the registry is lost while block maps survive on other shards.
# Returns {num, epoch, 1 when a new epoch began else 0}.
REGISTER = """
local now_s = redis.call('TIME')
local now = tonumber(now_s[1]) * 1000 + math.floor(tonumber(now_s[2]) / 1000)
local num, epoch
local current = redis.call('HGET', KEYS[1], ARGV[1])
if current then
  num, epoch = string.match(current, '^(%d+) (%d+)')
end
if not num then
  num = redis.call('INCR', KEYS[2])
  epoch = 0
end
local fresh = 0
if ARGV[4] == '1' or redis.call('EXISTS', KEYS[3]) == 0 then
  epoch = math.max(tonumber(epoch) + 1, now)
  fresh = 1
end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d %d %d', num, epoch, now))
redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[2])
return {tonumber(num), string.format('%d', epoch), fresh}
"""

# KEYS: nodes, next, lease prefix.  ARGV: forget_after_ms.
# Returns {next, {node_id, num, epoch, pttl_ms, info or false}, ...}; pttl -2 = no lease.
# Registry entries of nodes without a lease for forget_after_ms are dropped, which makes
# their node numbers orphans whose block maps MATCH collects.
VIEW = """
local now_s = redis.call('TIME')
local now = tonumber(now_s[1]) * 1000 + math.floor(tonumber(now_s[2]) / 1000)
local out = {redis.call('GET', KEYS[2]) or '0'}
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local node_id = entries[i]
  local num, epoch, seen = string.match(entries[i + 1], '^(%d+) (%d+) (%d+)$')
  local lease = KEYS[3] .. node_id
  local pttl = redis.call('PTTL', lease)
  if pttl == -2 and now - tonumber(seen) > tonumber(ARGV[1]) then
    redis.call('HDEL', KEYS[1], node_id)
  else
    local info = false
    if pttl ~= -2 then info = redis.call('GET', lease) end
    out[#out + 1] = {node_id, num, epoch, pttl, info}
  end
end
return out
"""

# KEYS: namespace prefix "{p:ns}".  ARGV: num, epoch, then (op, hashes) pairs where op is
# "S<t>" stored in tier t, "R<t>" removed from t, "M<s><d>" moved s → d, and hashes are
# 16-byte block hashes concatenated.  The first write of a new epoch drops the node's old
# map here.  Returns 1, or -1 when a newer epoch of this node already owns the map (the
# caller is a stale process of the same node id).
APPLY = """
local prefix, num, epoch = KEYS[1], ARGV[1], ARGV[2]
local holders_key, key = prefix .. ':holders', prefix .. ':m:' .. num
local held = redis.call('HGET', holders_key, num)
if held ~= epoch then
  if held and tonumber(held) > tonumber(epoch) then return -1 end
  redis.call('UNLINK', key)
  redis.call('HSET', holders_key, num, epoch)
end
local BATCH = 2000
for i = 3, #ARGV, 2 do
  local op, blob = ARGV[i], ARGV[i + 1]
  local kind, a, b = string.sub(op, 1, 1), tonumber(string.sub(op, 2, 2)), tonumber(string.sub(op, 3, 3))
  local set, clear = 0, 0
  if kind == 'S' then set = bit.lshift(1, a)
  elseif kind == 'R' then clear = bit.lshift(1, a)
  else set, clear = bit.lshift(1, b), bit.lshift(1, a) end
  local total = #blob / 16
  for first = 0, total - 1, BATCH do
    local hashes = {}
    for k = first + 1, math.min(first + BATCH, total) do
      hashes[#hashes + 1] = string.sub(blob, k * 16 - 15, k * 16)
    end
    local old = redis.call('HMGET', key, unpack(hashes))
    local writes, deletes = {}, {}
    for k = 1, #hashes do
      local before = tonumber(old[k] or 0)
      local after = bit.bor(bit.band(before, bit.bnot(clear)), set)
      if after == 0 then
        if before ~= 0 then deletes[#deletes + 1] = hashes[k] end
      elseif after ~= before then
        writes[#writes + 1] = hashes[k]
        writes[#writes + 1] = after
      end
    end
    if #writes > 0 then redis.call('HSET', key, unpack(writes)) end
    if #deletes > 0 then redis.call('HDEL', key, unpack(deletes)) end
  end
end
return 1
"""

MATCH_STRIDE = 64  # the widest gap between two probes of one tier run (below)

# KEYS: namespace prefix "{p:ns}".  ARGV: chain (16-byte hashes concatenated), next (the
# registry's last node number), then (num, epoch, state) triples for every node the
# registry knows: state "c" = a live candidate, "l" = live but not asked about, "d" = its
# lease was gone.  Returns {num_maps_collected, {num, length, tier, count, tier, count, ...},
# ...}: one entry per candidate holding at least the first block, its matched blocks'
# fastest tiers run-length encoded.
#
# A node's prefix is searched, not walked: from the first block of a run of one tier, the
# script probes 1, 2, 4, … MATCH_STRIDE blocks on, then every MATCH_STRIDE blocks, and the
# chain's last block (HMGET in batches of 8, 16, … 256 probes); at the first probe that
# finds another tier or no block, it bisects back to the last probe in the run for where
# the run ends. A missing block there ends the prefix; another tier starts the next run.
# An 8K-block chain costs a node ~length/MATCH_STRIDE + 13 probes per tier run, instead of
# a read of every block. What that answers:
# - exact when the node's holdings along the chain are prefix-closed (every block it holds
#   has its parent held — leaf-first eviction keeps them so): the length always, and every
#   block's tier unless two runs of one tier lie fewer than MATCH_STRIDE blocks apart
#   (t…t u…v t…t; the blocks between are found whenever they are at least as many as
#   the first run of t). Those blocks are then reported in tier t: the cost model's
#   transfer time is off, the length is not.
# - otherwise (holes: blocks the node lacks below ones it holds) never shorter than the
#   true prefix, and over-reporting only across holes the probes step over: a hole of w
#   blocks d blocks after the start of the tier run it interrupts is seen whenever
#   w >= min(d, MATCH_STRIDE), or when the blocks beyond it are in another tier, and the
#   prefix then ends at it or before. So the reported prefix never spans MATCH_STRIDE
#   missing blocks in a row, ends on a held block with a missing one (or the chain's end)
#   after it, and each reported run starts and ends on a block of its tier. E.g. held
#   blocks 0-39 and 45-1499, all in one tier: the probes at 32 and 64 both hit, and match
#   reports 1500 blocks where 40 form the true prefix. A fetch of such blocks gets what
#   the peer really holds (it leases the longest prefix it has, tiers/manager.py) and the
#   rest is recomputed: an over-report is a miss, never wrong data.
MATCH = (
    """
local prefix, chain = KEYS[1], ARGV[1]
local n, next_num = #chain / 16, tonumber(ARGV[2])
local view = {}
for i = 3, #ARGV, 3 do view[ARGV[i]] = {tonumber(ARGV[i + 1]), ARGV[i + 2]} end
local holders_key = prefix .. ':holders'
local holders = redis.call('HGETALL', holders_key)
local collected, candidates = 0, {}
for i = 1, #holders, 2 do
  local num, epoch = holders[i], tonumber(holders[i + 1])
  local known = view[num]
  local garbage
  if known == nil then
    garbage = tonumber(num) <= next_num
  else
    garbage = epoch < known[1] or (epoch == known[1] and known[2] == 'd')
    if epoch == known[1] and known[2] == 'c' then candidates[#candidates + 1] = num end
  end
  if garbage then
    redis.call('UNLINK', prefix .. ':m:' .. num)
    redis.call('HDEL', holders_key, num)
    collected = collected + 1
  end
end
local STRIDE = """
    + str(MATCH_STRIDE)
    + """
local LOWEST = {}
for mask = 1, 31 do
  local t = 0
  while bit.band(mask, bit.lshift(1, t)) == 0 do t = t + 1 end
  LOWEST[tostring(mask)] = t
end
-- the fastest tier of the block at each 1-based chain position of `positions`; false: none
local function tiers_at(key, positions)
  local fields = {}
  for j, i in ipairs(positions) do fields[j] = string.sub(chain, i * 16 - 15, i * 16) end
  local masks = redis.call('HMGET', key, unpack(fields))
  for j = 1, #masks do masks[j] = LOWEST[masks[j]] or false end
  return masks
end
-- the position past the run of tier t that starts at `first`, and that block's tier
local function run_end(key, first, t)
  local offset, batch, inside = 1, 8, first
  while inside < n do
    local probes = {}
    while #probes < batch and first + offset < n do
      probes[#probes + 1] = first + offset
      offset = offset < STRIDE and offset * 2 or offset + STRIDE
    end
    if #probes < batch then probes[#probes + 1] = n end
    local tiers = tiers_at(key, probes)
    for j, past in ipairs(probes) do
      local past_tier = tiers[j]
      if past_tier ~= t then
        -- bisect (inside, past]: `inside` is in t, `past` is not
        while past - inside > 1 do
          local middle = math.floor((inside + past) / 2)
          local tier = tiers_at(key, {middle})[1]
          if tier == t then inside = middle else past, past_tier = middle, tier end
        end
        return past, past_tier
      end
      inside = past
    end
    batch = math.min(batch * 2, 256)
  end
  return n + 1, false
end
local out = {collected}
for _, num in ipairs(candidates) do
  local key = prefix .. ':m:' .. num
  local tier = n > 0 and tiers_at(key, {1})[1]
  if tier then
    local runs = {num, 0}
    local first = 1
    while tier do
      local past, next_tier = run_end(key, first, tier)
      runs[#runs + 1] = tier
      runs[#runs + 1] = past - first
      first, tier = past, next_tier
    end
    runs[2] = first - 1
    out[#out + 1] = runs
  end
end
return out
"""
)

# KEYS: the session key.  ARGV: node_id, ttl_ms, moved_from ('' if none).
# A move is a change from the stored node, or, when the affinity had expired, from the
# node the caller says the session left.  Returns {num_moves, from ('' if no move)}.
SESSION_PUT = """
local current = redis.call('HMGET', KEYS[1], 'node', 'moves')
local moves = tonumber(current[2] or 0)
local from = ''
if current[1] and current[1] ~= ARGV[1] then from = current[1]
elseif not current[1] and ARGV[3] ~= '' and ARGV[3] ~= ARGV[1] then from = ARGV[3] end
if from ~= '' then moves = moves + 1 end
redis.call('HSET', KEYS[1], 'node', ARGV[1], 'moves', moves)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {moves, from}
"""

# KEYS: a session key; ARGV: from node, to node. Moves the session only if it still sticks
# to the draining node (a router may have moved it meanwhile); its TTL is kept.
SESSION_REASSIGN = """
if redis.call('HGET', KEYS[1], 'node') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'node', ARGV[2])
  redis.call('HINCRBY', KEYS[1], 'moves', 1)
  return 1
end
return 0
"""
