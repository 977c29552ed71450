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

local function task_field(task)
  if #task == 36 and string.find(task, UUID_FORM) and task == string.lower(task) then
    local hex = string.gsub(task, '%-', '')
    local out = {}
    for i = 1, 32, 8 do
      local v = tonumber(string.sub(hex, i, i + 7), 16)
      out[#out + 1] = (v - v % 16777216) / 16777216
      out[#out + 1] = (v - v % 65536) / 65536 % 256
      out[#out + 1] = (v - v % 256) / 256 % 256
      out[#out + 1] = v % 256
    end
    return string.char(unpack(out))
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
