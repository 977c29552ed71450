-- redrive: dead letters of this thread re-enter it at their original place: the arrival number
-- (seq) and scheduled_at they had when they died (kill_active keeps both in the dead record's
-- meta), same task id, retries reset.  So they are released in their original order and before
-- members that arrived after them.  A dead record written before records kept their place
-- re-enters as a new arrival (now, a new seq).  The head is released once all are back.  A
-- letter keeps its policy (its meta's), and a hold its death made (on_death="hold") is lifted:
-- it runs first, at its place.
--   ARGV[6] caller: the call's own id, the same when it is sent again (CALLER in _common.lua)
--   ARGV[7...] per dead letter: task id, max_retries (-1: unlimited), retry delay ms
-- Returns {1, codes} plus the release, if any; codes holds one character per dead letter, in
-- order: 'r' back at its place, 'n' back as a new arrival (its record kept no place), 'a' a
-- member already (it stays in the store), '-' not in the store (or of another thread).
-- Replayed (its reply lost): a letter this call redrove answers 'r' again (the call is
-- remembered per letter in the ended index for ENDED_WINDOW as "\0redriven:<caller>:<task>"),
-- so it is never redriven twice, and the release the call made is returned again while it is
-- still RELEASED (for the caller to publish; a second copy loses the claim).
CALLER = ARGV[6]
local codes, again = {}, {}
for i = 7, #ARGV, 3 do
  local task = ARGV[i]
  local mark = '\0redriven:' .. CALLER .. ':' .. task
  local rec = redis.call('HGET', K_DEADREC, task)
  local code = '-'
  if rec then
    local after_time = string.find(rec, '\n', 1, true)
    local after_meta = string.find(rec, '\n', after_time + 1, true)
    local ok, meta = pcall(cjson.decode, string.sub(rec, after_time + 1, after_meta - 1))
    if ok and type(meta) == 'table' and tostring(meta.thread_id) == TID then
      local seq, sched = meta.seq, meta.sched
      code = 'r'
      if type(seq) ~= 'number' or type(sched) ~= 'number' then
        seq, sched, code = next_seq(), NOW, 'n'
      end
      local policy = type(meta.policy) == 'string' and meta.policy ~= '' and meta.policy or nil
      if add_member(task, sched, 0, ARGV[i + 1], ARGV[i + 2], string.sub(rec, after_meta + 1),
                    true, string.format('%d', seq), policy) == false then
        code = 'a'
      else
        redis.call('ZREM', K_DEAD, task)
        redis.call('HDEL', K_DEADREC, task)
        lift_hold(task)
        if CALLER ~= '' then redis.call('ZADD', K_ENDED, NOW, mark) end
      end
    end
  elseif CALLER ~= '' and ended_lately(mark) then
    code = 'r'
    again[task] = true
  end
  codes[#codes + 1] = code
end
local released = release_head()
if released == nil and next(again) then
  local a = redis.call('HMGET', K_A, 'task', 'token', 'state')
  if a[1] and again[a[1]] and a[3] == 'RELEASED' then
    local _, rec = find_member(K_TASKS, a[1])
    return reply(1, table.concat(codes), { a[1], a[2], rec })
  end
end
return reply(1, table.concat(codes), released)
