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
--            members (its active one not counted), after the duplicate checks; '' none
-- Returns {1, ''} added (plus the release, if any: without the record when it is this member's),
-- {0, ''} when the task id is already a member; when that member is RELEASED (an enqueue replayed
-- after its reply was lost, which released it), {0, ''} plus its release with its stored record,
-- for the caller to publish (a second copy loses the claim); {2, 'full'} when max_waiting
-- refused it (nothing stored).
local task = ARGV[6]
local admission = nil
if ARGV[12] and ARGV[12] ~= '' then
  admission = '\0replaced:' .. ARGV[12] .. ':' .. task
  local at = redis.call('ZSCORE', K_ENDED, admission)
  if at and tonumber(at) >= NOW - ENDED_WINDOW then return reply(0, '') end
end
local policy = ARGV[13] ~= '' and ARGV[13] or nil
local released = add_member(task, schedule(ARGV[7], ARGV[8]), 0, ARGV[9], ARGV[10], ARGV[11],
  admission ~= nil, nil, policy, ARGV[14] and tonumber(ARGV[14]))
if released == 'full' then return reply(2, 'full') end
if released == false then
  local a = redis.call('HMGET', K_A, 'task', 'token', 'state')
  if a[1] == task and a[3] == 'RELEASED' then
    local _, rec = find_member(K_TASKS, task)
    return reply(0, '', { task, a[2], rec })
  end
  return reply(0, '')
end
if admission then redis.call('ZADD', K_ENDED, NOW, admission) end
return reply(1, '', released, released ~= nil and released[1] == task)
