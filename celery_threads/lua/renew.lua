-- renew: a worker vouches for a member it holds, fenced by its token: a running member's lease, or
-- the release deadline of one waiting in the worker's prefetch buffer, becomes now + keepalive.
--   ARGV[5] task id   ARGV[6] token   ARGV[7] keepalive ms
-- Returns {1, ''} renewed, {0, ''} when the member no longer holds the thread under that token.
if not is_active(ARGV[5], ARGV[6]) then return reply(0, '') end
local deadline = NOW + tonumber(ARGV[7])
redis.call('HSET', K_A, 'deadline', deadline)
redis.call('ZADD', K_LEASES, deadline, TID)
return reply(1, '')
