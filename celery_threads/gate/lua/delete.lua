-- delete: detach a member whatever its state and promote the next member, at once or, for a
-- member running in a process that can be stopped, once its worker has stopped it.
--   ARGV[6] task id   ARGV[7] token required when the member is active ("" = any)
--   ARGV[8] "1" to delete only a WAITING member (a plain revoke must not detach a running one),
--           "2" only the active member RELEASED under that token (one that expired unclaimed:
--           a worker may have claimed it since),
--           "3" as "0", but a RUNNING member whose claim says its process can be stopped
--           ('stop', claim.lua ARGV[11]) is only marked deleted ('del', see marked_deleted):
--           it stays active, and the next member is released once it has ended (its worker's
--           main process ends it with "0" and its token when its pool process has exited)
--   ARGV[9] caller: the call's own id, the same when it is sent again (CALLER in _common.lua)
--   ARGV[10] holder: a worker process's claimant prefix; refused while the member is RUNNING
--            under another process's claim (see held_elsewhere; optional)
-- Returns {1, previous state} plus the release, {1, 'STOPPING'} when the member was marked (or
-- was marked already), or {0, ''} when nothing was deleted.  Replayed (its reply lost), it
-- returns the same while the member it released is active (see replayed), else {1, 'ENDED'}
-- when the member ended lately (it may have been RUNNING).
local task, token = ARGV[6], ARGV[7]
CALLER = ARGV[9] or ''
local field, rec = find_member(K_TASKS, task)
if rec == false then
  if ARGV[8] == '1' then return reply(0, '') end
  local a = redis.call('HMGET', K_A, 'prev')
  local mark = 'd|' .. task .. '|'
  local was = a[1] and string.sub(a[1], 1, #mark) == mark
    and string.match(string.sub(a[1], #mark + 1), '^([^|]*)|')
  if was then
    local again = replayed('d', task, was, '')
    if again then return again end
  end
  if ended_lately(task) then return reply(1, 'ENDED') end
  return reply(0, '')
end
local p = parse_record(rec)
if p.thread ~= TID then return reply(0, '') end
local state = active_state(task)
if state then
  if ARGV[8] == '1' then return reply(0, state) end
  if token ~= '' and not is_active(task, token) then return reply(0, state) end
  if ARGV[8] == '2' and state ~= 'RELEASED' then return reply(0, state) end
  if held_elsewhere(state, ARGV[10]) then return reply(0, state) end
  if ARGV[8] == '3' and state == 'RUNNING' and redis.call('HGET', K_A, 'stop') == '1' then
    redis.call('HSET', K_A, 'del', '1')
    return reply(1, 'STOPPING')
  end
  local current = redis.call('HGET', K_A, 'token')
  count_ending('deleted')
  drop_active(task, field)
  detached('d', task, current, 1, state)
else
  if token ~= '' then return reply(0, 'WAITING') end
  state = 'WAITING'
  left_waiting(task, rec)
  redis.call('ZREM', K_Q, queue_member(p.seq, field))
  redis.call('HDEL', K_TASKS, field)
  mark_ended(task)
  count_ending('deleted')
end
return reply(1, state, release_head())
