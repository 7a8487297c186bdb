-- Budget settlement (keel_core::quota::budget::Account::settle): the reservation is replaced
-- by the real amount. KEYS[1] the account; ARGV: window start, window end (Unix s), reserved,
-- actual, grace (s).
local a = account(KEYS[1], num(ARGV[1]))
a.reserved = math.max(a.reserved - num(ARGV[3]), 0)
a.spent = sat(a.spent + num(ARGV[4]))
save_account(KEYS[1], a, num(ARGV[2]), num(ARGV[5]))
return 1
