-- renew: a worker vouches for a member it holds, fenced by its token: a running member's lease, or
-- the release deadline of one waiting in the worker's prefetch buffer, becomes now + keepalive.
--   ARGV[6] task id   ARGV[7] token   ARGV[8] keepalive ms
-- Returns {1, ''} renewed, {0, ''} when the member no longer holds the thread under that token.
if not is_active(ARGV[6], ARGV[7]) then return reply(0, '') end
local deadline = NOW + tonumber(ARGV[8])
redis.call('HSET', K_A, 'deadline', deadline)
redis.call('ZADD', K_LEASES, deadline, TID)
return reply(1, '')
