-- renew: extend the lease of a running member, fenced by its token.
--   ARGV[5] task id   ARGV[6] token   ARGV[7] keepalive ms
-- Returns {1, ''} renewed, {0, ''} when the member no longer holds the thread under that token.
if is_active(ARGV[5], ARGV[6]) ~= 'RUNNING' then return reply(0, '') end
local deadline = NOW + tonumber(ARGV[7])
redis.call('HSET', K_A, 'deadline', deadline)
redis.call('ZADD', K_LEASES, deadline, TID)
return reply(1, '')
