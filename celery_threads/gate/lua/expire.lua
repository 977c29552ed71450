-- expire: the dispatcher's lease sweep for one thread whose deadline has passed.
--   ARGV[6] max republish backoff exponent   ARGV[7] keepalive, for the death reason
-- A RELEASED member nobody claimed is republished under the same token (the first delivery to
-- arrive wins the claim), its deadline backing off.  A RUNNING member whose lease lapsed counts as a
-- failed attempt: it re-enters after its retry delay while retries remain, else it dies.
-- A RUNNING member marked deleted (marked_deleted) whose lease lapsed ends as deleted: no worker
-- is left to stop it (a worker cut off from the gate kills its pool process before its lease
-- ends).
-- Returns {0, ''} nothing to do, {2, 'republish'} with the release to publish again,
-- {3, task} retried, {4, task} died, {5, task} ended as deleted; 3, 4 and 5 carry the next
-- release, if any, and 5 the member's stored record (7th).
local a = redis.call('HMGET', K_A, 'task', 'token', 'state', 'deadline', 'n')
if a[1] == false then
  -- Another dispatcher handled this thread since our scan; its head may be due by now.
  return reply(0, '', release_head())
end
local task, token, state, deadline = a[1], a[2], a[3], tonumber(a[4])
if deadline > NOW then
  redis.call('ZADD', K_LEASES, deadline, TID)
  return reply(0, '')
end
if state == 'RELEASED' then
  local n = tonumber(a[5]) + 1
  local backoff = math.min(n, tonumber(ARGV[6]))
  return republish_active(task, token, NOW + RELEASE_TIMEOUT * (2 ^ backoff), n)
end
count('lapses')
if marked_deleted() then
  count_ending('deleted')
  local field, rec = find_member(K_TASKS, task)
  drop_active(task, field)
  -- Its stored record, 7th (the release's five before it '' when there is none): the
  -- dispatcher marks it revoked with its request, which its chord and backend need.
  local out = reply(DELETED_LAPSE, task, release_head(true))
  for i = #out + 1, 6 do out[i] = '' end
  out[7] = rec or ''
  return out
end
local status = fail_active(task, 'LeaseExpired: the worker running it sent no keepalive for ' ..
  ARGV[7] .. ' (worker lost?), and no retries were left')
return reply(status, task, release_head(true))
