-- GCRA check-and-take (keel_core::quota::gcra::check, in microseconds).
-- KEYS[1] the key's theoretical arrival time; ARGV: now ('' = Redis's clock), period, limit, cost.
-- Returns {1, remaining, reset_after, tat} when admitted, {0, retry_after, reset_after} when not.
local now = clock(ARGV[1])
local period, cost = num(ARGV[2]), num(ARGV[4])
local t = interval(period, num(ARGV[3]))
local base = math.max(num(redis.call('GET', KEYS[1])), now)
local new_tat = sat(base + cost * t)
local allow_at = math.max(new_tat - period, 0)
if allow_at > now then
  return { 0, allow_at - now, base - now }
end
store_tat(KEYS[1], new_tat, now)
return { 1, math.floor((period - (new_tat - now)) / t), new_tat - now, new_tat }
