-- A key's state, read at one instant. KEYS: n rate states, then budget accounts, then the
-- key's slots; ARGV: now ('' = Redis's clock), n.
-- Returns {now (us), each tat, each account's start, spent, reserved, live slots}.
local now = clock(ARGV[1])
local n = num(ARGV[2])
local out = { now }
for i = 1, n do
  out[#out + 1] = num(redis.call('GET', KEYS[i]))
end
for i = n + 1, #KEYS - 1 do
  local h = redis.call('HMGET', KEYS[i], 'start', 'spent', 'reserved')
  out[#out + 1] = num(h[1])
  out[#out + 1] = num(h[2])
  out[#out + 1] = num(h[3])
end
out[#out + 1] = redis.call('ZCOUNT', KEYS[#KEYS], '(' .. int(math.floor(now / 1000)), '+inf')
return out
