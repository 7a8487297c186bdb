-- Pushes back the expiry of slots this replica still holds. KEYS[1] the key's slots; ARGV: now
-- ('' = Redis's clock), then token and ttl (ms) pairs. A slot that already expired stays gone:
-- another replica may have been given it. Returns how many were renewed.
local now = math.floor(clock(ARGV[1]) / 1000)
local renewed = 0
for i = 2, #ARGV - 1, 2 do
  local expiry = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if expiry and tonumber(expiry) > now then
    redis.call('ZADD', KEYS[1], 'XX', now + num(ARGV[i + 1]), ARGV[i])
    renewed = renewed + 1
  end
end
keep_slots(KEYS[1])
return renewed
