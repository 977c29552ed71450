-- requeue: the active member re-enters WAITING (retry, or its replacement) at its old arrival order.
--   ARGV[6] task id   ARGV[7] token   ARGV[8] "at"|"in"|"keep"   ARGV[9] ms ("at": scheduled_at,
--   "in": delay; "keep": unused, it keeps the scheduled_at it was released at)   ARGV[10] retries
--   ARGV[11] new envelope, or "" to keep the stored one
--   ARGV[12] max_retries (-1: unlimited), ARGV[13] retry delay ms (optional): a replacement's
--            (Task.replace), which takes the member's place with its own retry settings (and
--            the member's policies)
--   ARGV[14] caller: the call's own id, the same when it is sent again (CALLER in _common.lua)
-- Returns {1, ''} plus the release, or {0, ''} when (task, token) is not the active member (or
-- is RUNNING for another claimant than the caller); {1, 'DELETED'} plus the release when the
-- member was marked deleted (marked_deleted): it ends instead of waiting again.
-- Replayed (its reply lost), it returns the same while the member it released is active (see
-- replayed); else {0, ''}: a member waiting again may have been requeued by this call or by the
-- lapse of its lease, which this call must not be told it did.
local task, token = ARGV[6], ARGV[7]
CALLER = ARGV[14] or ''
local state, long, kept, by, del = is_active(task, token)
if not state then
  local again = replayed('r', task, token, '')
  if again then return again end
  return reply(0, '')
end
if not_the_claimants(state, by) then return reply(0, '') end
if marked_deleted(del) then
  count_ending('deleted')
  drop_active(task, active_field(task, long, kept))
  detached('r', task, token, 1, 'DELETED')
  return reply(1, 'DELETED', release_head(true))
end
local sched
if ARGV[8] == 'keep' then
  sched = tonumber(redis.call('HGET', K_A, 'sched')) or NOW
else
  sched = schedule(ARGV[8], ARGV[9])
end
local field, rec
if ARGV[12] and ARGV[12] ~= '' then
  field, rec = find_member(K_TASKS, task)
  local p = parse_record(rec)
  rec = make_record(p.seq, p.retries, ARGV[12], ARGV[13], string.sub(rec, p.body_at), p.tail,
    p.policy)
end
requeue_active(task, sched, ARGV[10], ARGV[11], field, rec)
-- A replacement (ARGV[12]) is a new task in the member's place, not another attempt.
if not (ARGV[12] and ARGV[12] ~= '') then count('retries') end
detached('r', task, token, 1, '')
return reply(1, '', release_head(true))
