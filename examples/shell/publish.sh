#!/usr/bin/env bash
# Publish one Celery task (protocol v2) through celery-redis-lua's publish script with
# nothing but redis-cli, base64, date, sha1sum and the kernel's uuid source.
#
#   examples/shell/publish.sh --url redis://127.0.0.1:6379/0 --queue celery \
#       --task proj.tasks.add --args '[1,2]' --priority 5 --countdown 3
#
# prints the task id. The script is lua/publish.lua of this repository (or --script /
# $CRL_PUBLISH_LUA), called with EVALSHA and loaded once on NOSCRIPT. redis-cli exits 0
# when the server answers with an error, so every reply is checked for what it must be.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
url=${CELERY_BROKER_URL:-redis://127.0.0.1:6379/0}
queue=celery task='' args='[]' kwargs='{}' priority=0 countdown=0 id='' prefix=''
visibility_ms=300000
script=${CRL_PUBLISH_LUA:-$here/../../lua/publish.lua}

usage() {
  echo "usage: $0 --task NAME [--url URL] [--queue celery] [--args JSON-array] [--kwargs JSON-object]"
  echo "       [--priority 0..255] [--countdown SECONDS] [--id TASK_ID] [--prefix GLOBAL_KEYPREFIX]"
  echo "       [--visibility-ms 300000] [--script PATH/publish.lua]"
}
fail() { echo "publish.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case $1 in -h|--help) usage; exit 0 ;; esac
  [ $# -ge 2 ] || fail "$1 needs a value"
  case $1 in
    --url) url=$2 ;; --queue) queue=$2 ;; --task) task=$2 ;; --args) args=$2 ;;
    --kwargs) kwargs=$2 ;; --priority) priority=$2 ;; --countdown) countdown=$2 ;;
    --id) id=$2 ;; --prefix) prefix=$2 ;; --visibility-ms) visibility_ms=$2 ;;
    --script) script=$2 ;;
    *) usage >&2; fail "unknown option $1" ;;
  esac
  shift 2
done

[ -n "$task" ] || { usage >&2; fail "--task is required"; }
[[ $priority =~ ^[0-9]+$ ]] && [ "$priority" -le 255 ] || fail "--priority must be an integer in 0..255"
[[ $countdown =~ ^[0-9]+(\.[0-9]{1,3})?$ ]] || fail "--countdown must be seconds >= 0 (up to 3 decimals)"
[[ $visibility_ms =~ ^[1-9][0-9]*$ ]] || fail "--visibility-ms must be a positive integer"
[[ -n $queue && $queue != *[{}]* ]] || fail "--queue must be non-empty, without { or }"
# --args and --kwargs go into the JSON as they are: check their outer shape at least.
[[ $args =~ ^[[:space:]]*\[.*\][[:space:]]*$ ]] || fail "--args must be a JSON array"
[[ $kwargs =~ ^[[:space:]]*\{.*\}[[:space:]]*$ ]] || fail "--kwargs must be a JSON object"
[ -r "$script" ] || fail "cannot read the publish script $script"
url=${url/#redislua:/redis:}   # Celery's scheme for this transport; redis-cli speaks redis://
url=${url/#redisluas:/rediss:}

json_string() {  # a JSON string literal (quotes, backslashes and control characters escaped)
  local s=$1
  s=${s//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\n'/\\n}; s=${s//$'\r'/\\r}; s=${s//$'\t'/\\t}
  printf '"%s"' "$s"
}
uuid() { cat /proc/sys/kernel/random/uuid; }

cli() { redis-cli --no-auth-warning -u "$url" "$@"; }

# The ETA is judged by the server's clock (the scripts read TIME), so compute it from TIME.
eta_ms='' eta=null
if [ "$countdown" != 0 ] && [[ ! $countdown =~ ^0+(\.0+)?$ ]]; then
  time_reply=$(cli TIME) || fail "redis-cli failed"
  { read -r seconds; read -r micros; } <<<"$time_reply"
  [[ $seconds =~ ^[0-9]+$ && $micros =~ ^[0-9]+$ ]] || fail "TIME: ${time_reply%%$'\n'*}"
  whole=${countdown%%.*} frac=000
  [[ $countdown == *.* ]] && frac=${countdown#*.}000
  eta_ms=$(( seconds * 1000 + 10#$micros / 1000 + 10#$whole * 1000 + 10#${frac:0:3} ))
  eta=\"$(date -u -d "@$(( eta_ms / 1000 )).$(printf '%03d' $(( eta_ms % 1000 )))" '+%Y-%m-%dT%H:%M:%S.%3N+00:00')\"
fi

id=${id:-$(uuid)}
body=$(printf '[%s,%s,{"callbacks":null,"errbacks":null,"chain":null,"chord":null}]' "$args" "$kwargs" \
       | base64 -w0)
headers='{"lang":"py","task":'$(json_string "$task")',"id":'$(json_string "$id")',"shadow":null,'
headers+='"eta":'$eta',"expires":null,"group":null,"group_index":null,"retries":0,'
headers+='"timelimit":[null,null],"root_id":'$(json_string "$id")',"parent_id":null,'
headers+='"argsrepr":'$(json_string "$args")',"kwargsrepr":'$(json_string "$kwargs")','
headers+='"origin":'$(json_string "shell-$$@${HOSTNAME:-localhost}")',"ignore_result":false,'
headers+='"replaced_task_nesting":0,"stamped_headers":null,"stamps":{}}'
properties='{"correlation_id":'$(json_string "$id")',"reply_to":"","delivery_mode":2,'
properties+='"delivery_info":{"exchange":"","routing_key":'$(json_string "$queue")'},'
properties+='"priority":'$priority',"body_encoding":"base64","delivery_tag":"'$(uuid)'"}'
payload='{"body":"'$body'","content-encoding":"utf-8","content-type":"application/json",'
payload+='"headers":'$headers',"properties":'$properties'}'

tag="{$queue}"
keys=("${prefix}queue:$tag" "${prefix}delayed:$tag" "${prefix}messages_index:$tag" "${prefix}meta:$tag"
      "${prefix}dead:$tag" "${prefix}message:$tag" "${prefix}state:$tag" "${prefix}wake:$tag")
argv=("$payload" "$priority" "$eta_ms" '' "$visibility_ms" "$id")  # the task id: for where/cancel
sha=$(sha1sum <"$script") && sha=${sha%% *}

# EVALSHA with the file's SHA1; on NOSCRIPT (a fresh, restarted or flushed server) load
# the file's exact bytes once and retry. The reply must be a 14-hex-digit message id.
reply=$(cli EVALSHA "$sha" 8 "${keys[@]}" "${argv[@]}") || fail "redis-cli failed"
if [[ $reply == NOSCRIPT* ]]; then
  loaded=$(cli -x SCRIPT LOAD <"$script") || fail "redis-cli failed"
  [ "$loaded" = "$sha" ] || fail "SCRIPT LOAD: ${loaded%%$'\n'*}"
  reply=$(cli EVALSHA "$sha" 8 "${keys[@]}" "${argv[@]}") || fail "redis-cli failed"
fi
[[ $reply =~ ^[0-9a-f]{14}$ ]] || fail "publish: ${reply%%$'\n'*}"
echo "$id"
