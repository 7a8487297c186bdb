-- GCRA after the fact (keel_core::quota::gcra::charge / refund, in microseconds).
-- KEYS[1] the key's theoretical arrival time; ARGV: now ('' = Redis's clock), period, limit,
-- 'charge' or 'refund', units.
local now = clock(ARGV[1])
local t = interval(num(ARGV[2]), num(ARGV[3]))
local units = num(ARGV[5])
local tat = num(redis.call('GET', KEYS[1]))
if ARGV[4] == 'charge' then
  tat = sat(math.max(tat, now) + units * t)
else
  tat = math.max(tat - units * t, 0)
end
store_tat(KEYS[1], tat, now)
return 1
