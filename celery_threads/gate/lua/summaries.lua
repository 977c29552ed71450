-- summaries: a consistent read of some threads of one shard (no writes), for health reads.
--   KEYS[1] the shard's tasks hash, then each thread's active and queue keys
-- Returns, per thread, {its active hash as a flat field/value list, how many members wait, its
-- head's task id or '', its head's scheduled_at or ''}.
local out = {}
for i = 2, #KEYS, 2 do
  local head = redis.call('ZRANGE', KEYS[i + 1], 0, 0, 'WITHSCORES')
  local task = ''
  if head[1] then
    local field = member_field(head[1])
    local rec = redis.call('HGET', KEYS[1], field)
    task = rec and field_task(field, rec) or ''
  end
  out[#out + 1] = { redis.call('HGETALL', KEYS[i]), redis.call('ZCARD', KEYS[i + 1]), task,
                    head[2] or '' }
end
return out
