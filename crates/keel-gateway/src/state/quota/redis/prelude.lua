-- Shared by every keel quota script (prepended to each). One script runs atomically, so a
-- check and its update can never interleave with another replica's.
--
-- Units: rate state and clocks are integer MICROseconds since the Unix epoch (Redis's TIME),
-- slot expiries integer milliseconds. Both stay far below 2^53 (about 9.0e15; now is about
-- 1.8e15 us), where Lua's numbers, which are doubles, hold every integer exactly.

-- Amounts and times come from requests and upstreams (a usage of 2^64 - 1 tokens): sums and
-- products saturate here, 2^53 being far beyond any limit or instant and still exact. Unclamped,
-- they would overflow Redis's integer replies and its expiry times.
local MAX_EXACT = 9007199254740992
local function sat(v)
  return math.min(v, MAX_EXACT)
end

-- Redis's clock, so that replicas with skewed clocks agree. Only the tests pass a time.
local function clock(given)
  if given ~= nil and given ~= '' then
    return tonumber(given)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- A stored number, or 0 for a missing one (GET and HMGET answer false).
local function num(v)
  return tonumber(v) or 0
end

-- An integer as digits; Lua's own formatting would switch to an exponent.
local function int(v)
  return string.format('%.0f', v)
end

-- GCRA (keel_core::quota::gcra): the time per unit, at least 1.
local function interval(period, limit)
  return math.max(math.floor(period / math.max(limit, 1)), 1)
end

-- Stores a theoretical arrival time. Once it has passed, the state equals a key never seen
-- (check takes max(tat, now)), so the key expires then.
local function store_tat(key, tat, now)
  if tat <= now then
    redis.call('DEL', key)
  else
    redis.call('SET', key, int(tat), 'PX', int(math.ceil((tat - now) / 1000)))
  end
end

-- A budget account (keel_core::quota::budget::Account): a hash {start, spent, reserved},
-- rolled into the window starting at `wstart`. Only forward: a replica whose clock is still in
-- the previous window counts into the newer one rather than resetting what was spent in it.
local function account(key, wstart)
  local h = redis.call('HMGET', key, 'start', 'spent', 'reserved')
  local a = { start = num(h[1]), spent = num(h[2]), reserved = num(h[3]) }
  a.current = wstart >= a.start
  if wstart > a.start then
    a.start = wstart
    a.spent = 0
  end
  return a
end

-- Writes an account back; it expires `grace` seconds after its window ends (long enough for
-- reservations still in flight at the turn to settle into the next window).
local function save_account(key, a, wend, grace)
  redis.call('HSET', key, 'start', int(a.start), 'spent', int(a.spent), 'reserved', int(a.reserved))
  if a.current then
    redis.call('EXPIREAT', key, int(wend + grace))
  end
end

-- A key's in-flight slots (a sorted set of tokens scored by expiry, ms) lives as long as its
-- longest-lived slot.
local function keep_slots(key)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIREAT', key, int(tonumber(last[2])))
  end
end
