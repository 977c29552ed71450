-- The gate's clock, prepended to every script (transitions and the dispatcher's scan).
-- `override` is "" to use the Redis server's TIME (always, outside the model-based test), else
-- milliseconds.  Returns milliseconds, the same as text, and the same reading in microseconds as
-- text (the shard counter's floor, see next_seq in _common.lua).  The texts are cut from TIME's
-- own reply: a number made text costs Redis a printf, and the scripts pass these as arguments.
local function server_clock(override)
  if override ~= '' then
    local ms = tonumber(override)
    local text = string.format('%d', ms)
    return ms, text, text .. '000'
  end
  local t = redis.call('TIME')
  local us = string.sub('00000' .. t[2], -6)
  local ms = t[1] .. string.sub(us, 1, 3)
  return tonumber(ms), ms, t[1] .. us
end

local function server_now_ms(override)
  return (server_clock(override))
end
