-- Budget reservation (keel_core::quota::budget::Account::reserve).
-- KEYS[1] the account; ARGV: limit, window start, window end (Unix s), amount, grace (s).
-- Returns {1, 0} when held, {0, what the window still had free} when not.
local a = account(KEYS[1], num(ARGV[2]))
local limit, amount = num(ARGV[1]), num(ARGV[4])
local used = a.spent + a.reserved
if used + amount > limit then
  return { 0, math.max(limit - used, 0) }
end
a.reserved = sat(a.reserved + amount)
save_account(KEYS[1], a, num(ARGV[3]), num(ARGV[5]))
return { 1, 0 }
