-- claim: a worker takes the released member it received, fenced by the release's token.
--   ARGV[6] task id   ARGV[7] token   ARGV[8] keepalive ms   ARGV[9] worker hostname
--   ARGV[10] claimant: this delivery's own id (optional), kept as the active member's 'by': the
--            lease is renewed, and the member ended, only by the claimant (renew.lua)
--   ARGV[11] "1": the claiming process can be stopped from outside (a prefork pool process,
--            whose worker's main process signals it and sees it exit), so a delete of the
--            running member waits for it to stop (marked_deleted); else it is detached at once
-- A member of a thread_rate_limit (its 'rl', release_idle) stamps the thread's last release
-- with its claim's time: the next release waits for its interval after this start.
-- Returns {1, claim time ms} claimed (also to the same claimant's replay of the claim, with the
-- first claim's time), {2, ''} already claimed by another delivery, {0, ''} stale.
local task, token, claimant = ARGV[6], ARGV[7], ARGV[10] or ''
local state, _, every = is_active(task, token)
if state == 'RELEASED' then
  if every then rate_stamp(tonumber(every)) end
  local deadline = NOW + tonumber(ARGV[8])
  redis.call('HSET', K_A, 'state', 'RUNNING', 'claimed', NOW, 'deadline', deadline, 'worker', ARGV[9],
    'by', claimant, 'stop', ARGV[11] or '')
  redis.call('ZADD', K_LEASES, deadline, TID)
  return reply(1, tostring(NOW))
elseif state == 'RUNNING' then
  if claimant ~= '' then
    local a = redis.call('HMGET', K_A, 'by', 'claimed')
    if a[1] == claimant then return reply(1, a[2]) end
  end
  return reply(2, '')
end
return reply(0, '')
