-- One concurrency slot. KEYS[1] the key's slots; ARGV: now ('' = Redis's clock), max, ttl (ms),
-- token. Expired slots (a replica that died holding them) are dropped first.
-- Returns 1 when held, 0 when all `max` are taken.
local now = math.floor(clock(ARGV[1]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= num(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + num(ARGV[3]), ARGV[4])
keep_slots(KEYS[1])
return 1
