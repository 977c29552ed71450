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
-- is_active's fencing check, with what the wait histogram and the rate need in the same read.
local a = redis.call('HMGET', K_A, 'task', 'token', 'state', 'sched', 'w', 'rl')
local state = a[1] == task and a[2] == token and a[3] or nil
local every = a[6]
if state == 'RELEASED' then
  if every then rate_stamp(tonumber(every)) end
  local deadline = ms_text(NOW + ARGV[8])
  -- Its body starts: its wait ends, unless a claim of this release (given back unstarted) counted it.
  if not a[5] then observe_wait(a[4]) end
  redis.call('HSET', K_A, 'state', 'RUNNING', 'claimed', NOW_TEXT, 'deadline', deadline,
    'worker', ARGV[9], 'by', claimant, 'stop', ARGV[11] or '', 'w', '1')
  count('running')
  redis.call('ZADD', K_LEASES, deadline, TID)
  return reply(1, NOW_TEXT)
elseif state == 'RUNNING' then
  if claimant ~= '' then
    local c = redis.call('HMGET', K_A, 'by', 'claimed')
    if c[1] == claimant then return reply(1, c[2]) end
  end
  return reply(2, '')
end
return reply(0, '')
