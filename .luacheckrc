-- Redis' Lua 5.1 sandbox: these globals are provided by the server.
std = "lua51"
read_globals = {"redis", "KEYS", "ARGV", "cjson", "cmsgpack", "bit", "struct"}
max_line_length = 120
max_comment_line_length = false
