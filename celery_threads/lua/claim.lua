-- claim: a worker takes the released member it received, fenced by the release's token.
--   ARGV[5] task id   ARGV[6] token   ARGV[7] keepalive ms   ARGV[8] worker hostname
-- Returns {1, ''} claimed, {2, ''} already claimed (duplicate delivery), {0, ''} stale.
local task, token = ARGV[5], ARGV[6]
local state = is_active(task, token)
if state == 'RELEASED' then
  local deadline = NOW + tonumber(ARGV[7])
  redis.call('HSET', K_A, 'state', 'RUNNING', 'claimed', NOW, 'deadline', deadline, 'worker', ARGV[8])
  redis.call('ZADD', K_LEASES, deadline, TID)
  return reply(1, '')
elseif state == 'RUNNING' then
  return reply(2, '')
end
return reply(0, '')
