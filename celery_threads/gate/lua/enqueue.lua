-- enqueue: a new member joins the thread; it is released at once when it is due and the thread is idle.
--   ARGV[6] task id   ARGV[7] "at"|"in"   ARGV[8] scheduled_at ms ("at") or delay ms ("in")
--   ARGV[9] max_retries (-1: unlimited)   ARGV[10] retry delay ms   ARGV[11] envelope
--   ARGV[12] (optional) replaced_task_nesting of a replacement: Task.replace gives it the replaced
--            task's id, which may have ended in the last ENDED_WINDOW (a chain's last step, a
--            replacement joining another thread).  Such an id is admitted once per nesting level:
--            the admission is remembered in the ended index as "\0replaced:<nesting>:<task id>",
--            so a replayed call is still refused.  A member is never admitted twice at once.
--   ARGV[13] (optional) the member's policy, kept in its record (make_record): '' none, else
--            'h' (on_death="hold") and/or 'r<ms>' (thread_rate_limit's interval)
--   ARGV[14] (optional) max_waiting: refused when the thread already has this many waiting
--            members (its active one not counted), after the duplicate checks; '' none.  A call
--            that supersedes a waiting one (ARGV[15]) leaves the count as it was: never refused
--   ARGV[15] (optional) coalesce="latest" or debounce: "" (neither), else
--            "<debounce ms>|<debounce_max ms>|<task name>" (0: none).  The call supersedes the
--            task's call in this thread that waits and has not been released yet (its 'w:'
--            field, see left_waiting), if any, and takes its place: that call's arrival number and
--            scheduled_at, or its own scheduled_at when that is later and in the future (a
--            countdown, an eta, a debounce).  The superseded member leaves the gate as a purged
--            one does.  debounce: scheduled no earlier than now + debounce (the server's
--            clock), but, with debounce_max, no later than debounce_max after the first call of
--            the burst (the first of the calls that superseded each other), unless the call's
--            own countdown or eta says later.  K_POLICY keeps 'c:<task name>' ->
--            "<task id>\n<burst start ms>\n<superseded>" of the task's latest call, where
--            <superseded> is the task id it superseded and the one that one superseded, if any,
--            one per line, so that a replay of that call (its reply lost) is told them again,
--            and the next call too: it reports its predecessor's (the producer marks them
--            REVOKED; a second time is harmless).  Not for a replacement's admission (ARGV[12]).
-- Returns {1, superseded} added (plus the release, if any: without the record when it is this
-- member's; and when the call superseded a waiting member, that member's stored record as a 7th
-- element, the release's five before it '' when there is none, so that its caller can count it
-- in its chord; a call with ARGV[15] scheduled in the future has its scheduled_at as an 8th,
-- the 7th '' when it superseded none), {0, ''} when the task id is already a member; when that
-- member is RELEASED (an enqueue replayed after its reply was lost, which released it), {0, ''}
-- plus its release with
-- its stored record, for the caller to publish (a second copy loses the claim); {2, 'full'}
-- when max_waiting refused it (nothing stored).  superseded: '' or the task ids the call
-- superseded as above (a replayed call's, while it is its task's latest call in the thread, the
-- 30 s after the last such call left the queue included).
local task = ARGV[6]
local admission = nil
if ARGV[12] and ARGV[12] ~= '' then
  admission = '\0replaced:' .. ARGV[12] .. ':' .. task
  local at = redis.call('ZSCORE', K_ENDED, admission)
  if at and tonumber(at) >= NOW - ENDED_WINDOW then return reply(0, '') end
end
local own = ARGV[13] and ARGV[13] ~= '' and ARGV[13] or ''
local cap = ARGV[14] and ARGV[14] ~= '' and tonumber(ARGV[14]) or nil
local policy = admission == nil and ARGV[15] and ARGV[15] ~= '' and ARGV[15] or nil
local sched = schedule(ARGV[7], ARGV[8])
if not policy then
  local released = add_member(task, sched, 0, ARGV[9], ARGV[10], ARGV[11], admission ~= nil, nil,
    own, cap)
  if released == 'full' then return reply(2, 'full') end
  if released == false then return duplicate_enqueue(task, '') end
  if admission then redis.call('ZADD', K_ENDED, NOW, admission) end
  return reply(1, '', released, released ~= nil and released[1] == task)
end

local debounce, most, name = string.match(policy, '^(%d+)|(%d+)|(.*)$')
debounce, most = tonumber(debounce), tonumber(most)
local latest = 'c:' .. name
local prev, start, told = nil, NOW, ''
local last = redis.call('HGET', K_POLICY, latest)
if last then prev, start, told = string.match(last, '^([^\n]*)\n(%d+)\n(.*)$') end
start = tonumber(start)
-- A duplicate (a replay: told what its first send superseded, while it is the task's latest
-- call here) supersedes nothing: the duplicate check comes first.
if is_known(task) then return duplicate_enqueue(task, prev == task and told or '') end
local place, superseded, gone = nil, '', nil
local waits = prev and redis.call('HEXISTS', K_POLICY, 'w:' .. prev) == 1
-- max_waiting: a call that supersedes a waiting one adds none.
if not waits and cap and redis.call('ZCARD', K_Q) >= cap then return reply(2, 'full') end
if waits then
  redis.call('HDEL', K_POLICY, 'w:' .. prev)
  -- Its 'w:' field says it waits and was never released: it leaves, and this call takes its
  -- place (the count of such calls stays).
  local field, rec = find_member(K_TASKS, prev)
  gone = rec
  local p = parse_record(rec)
  local member = queue_member(p.seq, field)
  place = { p.seq, tonumber(redis.call('ZSCORE', K_Q, member)) }
  redis.call('ZREM', K_Q, member)
  redis.call('HDEL', K_TASKS, field)
  mark_ended(prev)
  count_ending('deleted')   -- superseded: a deleted ending for the metrics
  superseded = prev .. (told ~= '' and '\n' .. string.match(told, '^[^\n]*') or '')
else
  start = NOW
  redis.call('HINCRBY', K_POLICY, 'n', 1)
end
redis.call('HSET', K_POLICY, latest, task .. '\n' .. string.format('%d', start) .. '\n' ..
  superseded, 'w:' .. task, '1')
redis.call('PERSIST', K_POLICY)
if debounce > 0 then
  local due = NOW + debounce
  if most > 0 then due = math.min(due, math.max(NOW, start + most)) end
  sched = math.max(sched, due)
end
-- Its record's policy has 'c' (make_record): its release, purge or delete ends its 'w:' field.
local released
if place then
  -- Its own time counts only when it is later than now (a countdown, an eta, a debounce).
  if sched <= NOW then sched = place[2] else sched = math.max(sched, place[2]) end
  add_member(task, sched, 0, ARGV[9], ARGV[10], ARGV[11], false, place[1], own .. 'c')
  released = release_head(false)
else
  released = add_member(task, sched, 0, ARGV[9], ARGV[10], ARGV[11], false, nil, own .. 'c')
end
local out = reply(1, superseded, released, released ~= nil and released[1] == task)
if gone or sched > NOW then
  for i = #out + 1, 6 do out[i] = '' end
  out[7] = gone or ''
  -- When it is due, if later than now: its caller's task-sent event says so (a debounce).
  if sched > NOW then out[8] = string.format('%d', sched) end
end
return out
