-- A thread queue's member: a waiting member's arrival number (seq) and task id, written so that
-- the byte order of members is their arrival order (members with equal scores sort by bytes) and
-- a Celery task id (a lowercase UUID) takes 17 bytes instead of 36:
--   <n: one byte, 1-7> <seq: n bytes, big-endian> ("u" <the UUID's 16 bytes> | ":" <task id>)
-- 21 bytes for a UUID and a seq below 2^24, where "<16-digit seq>:<uuid>" took 53
-- (celery_threads.gate.queued_task reads them in Python).
local UUID_FORM = '^%x%x%x%x%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%x%x%x%x%x%x%x%x$'
local UUID_TEXT = '%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x'

local function queue_member(seq, task)
  seq = tonumber(seq)
  local digits = {}
  while seq > 0 do
    table.insert(digits, 1, seq % 256)
    seq = (seq - seq % 256) / 256
  end
  local head = string.char(#digits, unpack(digits))
  if string.find(task, UUID_FORM) and task == string.lower(task) then
    return head .. 'u' .. string.gsub(string.gsub(task, '%-', ''), '%x%x',
      function(h) return string.char(tonumber(h, 16)) end)
  end
  return head .. ':' .. task
end

local function task_of(member)
  local at = string.byte(member, 1) + 2
  if string.sub(member, at, at) == 'u' then
    return string.format(UUID_TEXT, string.byte(member, at + 1, at + 16))
  end
  return string.sub(member, at + 1)
end
