-- handback: a worker returns a released member it holds unstarted, fenced by the release's token:
-- one in the prefetch buffer of a queue consumed without broker acknowledgements (whose message the
-- broker will not redeliver) when it shuts down, or one that finish claimed for a pool process that
-- cannot run it after all (ARGV[8] "1").
--   ARGV[6] task id   ARGV[7] token   ARGV[8] "1": the member may be RUNNING, claimed by the caller
--   and never started; it becomes RELEASED again (optional)
-- The member stays RELEASED under the same token and its release deadline restarts; the caller
-- publishes it again at once (the first delivery to be claimed wins, so a copy the worker still
-- starts is harmless).  Returns {2, 'republish', task, token, record}, or {0, ''} when the member
-- no longer holds the thread under that token or has been claimed (unless ARGV[8]).  A member
-- marked deleted (marked_deleted) that its claimant gives back never started: it ends as
-- deleted, {5, task} plus the next release.
local state, long, field, _, del = is_active(ARGV[6], ARGV[7])
if state == 'RUNNING' and ARGV[8] == '1' and marked_deleted(del) then
  count_ending('deleted')
  drop_active(ARGV[6], active_field(ARGV[6], long, field))
  return reply(DELETED_LAPSE, ARGV[6], release_head(true))
elseif state == 'RUNNING' and ARGV[8] == '1' then
  redis.call('HSET', K_A, 'state', 'RELEASED')
  count('running', -1)
  redis.call('HDEL', K_A, 'claimed', 'worker', 'by', 'stop')
elseif state ~= 'RELEASED' then
  return reply(0, '')
end
return republish_active(ARGV[6], ARGV[7], NOW + RELEASE_TIMEOUT)
