-- trim_dead: dead-letter retention for one shard (threads_dead_letter_max and _ttl), the oldest
-- deaths first, at most ARGV[4] per call; never a scan: the dead store is ordered by death, its
-- score the shard counter, which follows the server's clock in microseconds (next_seq in
-- _common.lua), so a letter older than the TTL scores below (now - ttl) in microseconds.
--   KEYS[1] dead     ZSET    task id -> death order
--   KEYS[2] deadrec  HASH    task id -> dead record
--   KEYS[3] dropped  STRING  counter: dead letters dropped by retention, ever
--   ARGV[1] now      "" to use the Redis server's TIME, else milliseconds (tests only)
--   ARGV[2] most dead letters the shard keeps ("" no bound)
--   ARGV[3] ttl ms ("" no bound)
--   ARGV[4] most letters dropped by this call
-- Returns {dropped by this call, 1 when more are due to be dropped else 0}.
local now = server_now_ms(ARGV[1])
local budget = tonumber(ARGV[4])
local n = 0
if ARGV[2] ~= '' then
  n = math.max(0, redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[2]))
end
if ARGV[3] ~= '' then
  local cutoff = string.format('%d', (now - tonumber(ARGV[3])) * 1000)
  n = math.max(n, redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. cutoff))
end
local more = n > budget and 1 or 0
n = math.min(n, budget)
if n == 0 then return { 0, 0 } end
local victims = redis.call('ZRANGE', KEYS[1], 0, n - 1)
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, n - 1)
redis.call('HDEL', KEYS[2], unpack(victims))
redis.call('INCRBY', KEYS[3], n)
return { n, more }
