-- scan: the dispatcher's read of one shard (no writes): what is due now, and when the next thing is.
-- Costs O(log n + limit): never a walk over idle or healthy threads.
--   KEYS[1] due      ZSET  thread id -> head scheduled_at (ms)
--   KEYS[2] leases   ZSET  thread id -> deadline (ms)
--   ARGV[1] now      "" to use the Redis server's TIME, else milliseconds (tests only)
--   ARGV[2] limit    most thread ids returned from each index
-- Returns {now, due thread ids, lapsed thread ids, next due score or "", next deadline or ""}.
local now = server_now_ms(ARGV[1])
local limit = tonumber(ARGV[2])
local bound = string.format('%d', now)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', bound, 'LIMIT', 0, limit)
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', bound, 'LIMIT', 0, limit)
local next_due = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. bound, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
local next_lease = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. bound, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
return { bound, due, lapsed, next_due[2] or '', next_lease[2] or '' }
