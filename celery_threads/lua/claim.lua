-- claim: a worker takes the released member it received, fenced by the release's token.
--   ARGV[6] task id   ARGV[7] token   ARGV[8] keepalive ms   ARGV[9] worker hostname
-- Returns {1, now ms} claimed, {2, ''} already claimed (duplicate delivery), {0, ''} stale.
local task, token = ARGV[6], ARGV[7]
local state = is_active(task, token)
if state == 'RELEASED' then
  local deadline = NOW + tonumber(ARGV[8])
  redis.call('HSET', K_A, 'state', 'RUNNING', 'claimed', NOW, 'deadline', deadline, 'worker', ARGV[9])
  redis.call('ZADD', K_LEASES, deadline, TID)
  return reply(1, tostring(NOW))
elseif state == 'RUNNING' then
  return reply(2, '')
end
return reply(0, '')
