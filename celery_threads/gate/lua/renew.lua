-- renew: a worker vouches for a member it holds, fenced by its token and claimant: a running
-- member's lease (renewed by its claimant only), or the release deadline of one waiting unclaimed
-- in the worker's prefetch buffer (no claimant), becomes now + keepalive.
--   ARGV[6] task id   ARGV[7] token   ARGV[8] keepalive ms
--   ARGV[9] claimant: the claim's (claim.lua ARGV[10]), or '' for a member held unclaimed
-- Returns {1, ''} renewed, {0, ''} when the member no longer holds the thread under that token,
-- {2, ''} when it does but not for this caller: claimed by another delivery, or (a claimant's
-- renewal of a member RELEASED again) its claim is gone.  A member claimed without a claimant
-- (an older worker's claim) is renewed by any holder of its token.
local state = is_active(ARGV[6], ARGV[7])
if not state then return reply(0, '') end
local claimant = ARGV[9] or ''
if state == 'RUNNING' then
  local by = redis.call('HGET', K_A, 'by')
  if by and by ~= claimant then return reply(2, '') end
elseif claimant ~= '' then
  return reply(2, '')
end
local deadline = NOW + tonumber(ARGV[8])
redis.call('HSET', K_A, 'deadline', deadline)
redis.call('ZADD', K_LEASES, deadline, TID)
return reply(1, '')
