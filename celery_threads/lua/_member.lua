-- How a member's task id is keyed: its field in the shard's tasks hash, and its member in the
-- thread's queue.
--
-- Field: a Celery task id (a lowercase UUID) as its 16 bytes; any other id as written when it is
-- shorter than 16 bytes, else behind a \1 byte.  The three forms never meet (16 bytes, fewer,
-- more), and a UUID's field fits a 32-byte allocation where its 36 characters took 48.
-- Queue member: <n: one byte, 1-7> <seq: n bytes, big-endian> <field>.  The byte order of members
-- is their arrival order (members with equal scores sort by bytes): 20 bytes for a UUID and a seq
-- below 2^24, where "<16-digit seq>:<uuid>" took 53.
-- celery_threads.gate reads both in Python (task_field, queued_task).
local UUID_FORM = '^%x%x%x%x%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%x%x%x%x%x%x%x%x$'
local UUID_TEXT = '%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x'

-- The four bytes of a 32-bit number, big-endian.
local function split4(v)
  local d = v % 256
  v = (v - d) / 256
  local c = v % 256
  v = (v - c) / 256
  local b = v % 256
  return (v - b) / 256, b, c, d
end

local function task_field(task)
  if #task == 36 and string.find(task, UUID_FORM) and not string.find(task, '%u') then
    local sub = string.sub
    local a1, a2, a3, a4 = split4(tonumber(sub(task, 1, 8), 16))
    local b1, b2, b3, b4 = split4(tonumber(sub(task, 10, 13) .. sub(task, 15, 18), 16))
    local c1, c2, c3, c4 = split4(tonumber(sub(task, 20, 23) .. sub(task, 25, 28), 16))
    local d1, d2, d3, d4 = split4(tonumber(sub(task, 29, 36), 16))
    return string.char(a1, a2, a3, a4, b1, b2, b3, b4, c1, c2, c3, c4, d1, d2, d3, d4)
  end
  if #task < 16 then return task end
  return '\1' .. task
end

local function field_task(field)
  if #field == 16 then return string.format(UUID_TEXT, string.byte(field, 1, 16)) end
  if #field < 16 then return field end
  return string.sub(field, 2)
end

local function queue_member(seq, field)
  seq = tonumber(seq)
  local digits = {}
  while seq > 0 do
    table.insert(digits, 1, seq % 256)
    seq = (seq - seq % 256) / 256
  end
  return string.char(#digits, unpack(digits)) .. field
end

local function member_field(member)
  return string.sub(member, string.byte(member, 1) + 2)
end
