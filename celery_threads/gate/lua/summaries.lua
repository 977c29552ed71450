-- summaries: a consistent read of some threads of one shard (no writes), for health reads.
--   KEYS[1] the shard's tasks hash, KEYS[2] its due index, then each thread's active and queue
--   keys; ARGV: the threads' ids, in the same order
-- Returns, per thread, {its active hash as a flat field/value list, how many members wait, its
-- head's task id or '', its head's scheduled_at or '', its score in the due index or '' (when
-- an idle thread's head is released: its scheduled_at, or later under a thread_rate_limit)}.
local out = {}
for i = 3, #KEYS, 2 do
  local head = redis.call('ZRANGE', KEYS[i + 1], 0, 0, 'WITHSCORES')
  local task = ''
  if head[1] then
    local field = member_field(head[1])
    local rec = redis.call('HGET', KEYS[1], field)
    task = rec and field_task(field, rec) or ''
  end
  out[#out + 1] = { redis.call('HGETALL', KEYS[i]), redis.call('ZCARD', KEYS[i + 1]), task,
                    head[2] or '', redis.call('ZSCORE', KEYS[2], ARGV[(i - 1) / 2]) or '' }
end
return out
