--[[ id_lists: lists of fixed-width items kept as one string (id lists, hash lists). ]]

-- Position (1-based) of item in a list of fixed-width items, or nil.
local function list_find(list, item, width)
  local start = 1
  while true do
    local pos = string.find(list, item, start, true)
    if not pos then return nil end
    if (pos - 1) % width == 0 then return pos end
    start = pos + 1
  end
end

-- The list without the items in set; returns the new list and how many items were removed.
local function list_without(list, set, width)
  local kept, removed = nil, 0
  for i = 1, #list, width do
    local item = string.sub(list, i, i + width - 1)
    if set[item] then
      if not kept then kept = {string.sub(list, 1, i - 1)} end
      removed = removed + 1
    elseif kept then
      kept[#kept + 1] = item
    end
  end
  if not kept then return list, 0 end
  return table.concat(kept), removed
end

-- The list with only the items in set.
local function list_only(list, set, width)
  local kept, dropped = {}, false
  for i = 1, #list, width do
    local item = string.sub(list, i, i + width - 1)
    if set[item] then kept[#kept + 1] = item else dropped = true end
  end
  if not dropped then return list end
  return table.concat(kept)
end

-- The items of a list as a set (added to set when given).
local function list_set(list, width, set)
  set = set or {}
  for i = 1, #list, width do set[string.sub(list, i, i + width - 1)] = true end
  return set
end
