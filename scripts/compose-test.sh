#!/usr/bin/env bash
# docker-compose.yml run for real (make compose-test). Builds the images without a registry
# (scripts/docker-images.sh), brings up PostgreSQL (pgvector, RUM), the migrations, the API and
# two workers as the project "mnemo-compose-test", and drives them through the API's published
# port, 127.0.0.1:$MNEMO_API_PORT (default 18080):
#   1. writes memories, waits until they are embedded, recalls them;
#   2. down and up with the volume kept: the same rows are recalled;
#   3. writes 1,000 rows, kills (SIGKILL) the worker holding the most embed jobs mid-batch, and
#      waits for the other worker to embed every row and finish the killed one's jobs.
# Prints PASS or FAIL per check and the run time; exits non-zero on a failure. The stack and its
# volume are removed at the end, failed or not. Honours CARGO_TARGET_DIR.
set -euo pipefail
started=$(date +%s)
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=env.sh
. "$here/env.sh"
# shellcheck source=debian.sh
. "$here/debian.sh"
cd "$mnemo_root"

export MNEMO_API_PORT=${MNEMO_API_PORT:-18080} MNEMO_JWT_SECRET
bash scripts/docker-images.sh
log "images ready in $(($(date +%s) - started)) s"
command -v jq >/dev/null || apt_install jq
sudo=()
docker info >/dev/null 2>&1 || sudo=(sudo --preserve-env)
docker=("${sudo[@]}" docker)
if "${docker[@]}" compose version >/dev/null 2>&1; then
  compose=("${docker[@]}" compose)
else
  command -v docker-compose >/dev/null || apt_install docker-compose
  compose=("${sudo[@]}" docker-compose)
fi
dc() { "${compose[@]}" -p mnemo-compose-test "$@"; }

failed=0
pass() { printf 'PASS  %s\n' "$*"; }
fail() { printf 'FAIL  %s\n' "$*"; failed=1; }
finish() {
  local rc=$?
  [ "$failed" = 0 ] && [ "$rc" = 0 ] || { dc logs --no-color --tail 30 >&2 || true; failed=1; }
  log "removing the stack and its volume"
  dc down -v --remove-orphans >/dev/null 2>&1 || true
  printf '%s in %d s\n' "$([ "$failed" = 0 ] && echo PASS || echo FAIL)" $(($(date +%s) - started))
  exit "$failed"
}
trap finish EXIT

api="http://127.0.0.1:$MNEMO_API_PORT"
# POST to $1 the body on stdin, with the test's token; the response on stdout, non-zero on an
# HTTP error.
post() { curl -sS -f -H "Authorization: Bearer $token" -H 'content-type: application/json' "$api$1" --data-binary @-; }
# docker exec rather than docker-compose exec, which takes seconds on a loaded machine.
# PostgreSQL's own user in its container (peer authentication), for read-only checks:
sql() { "${docker[@]}" exec "$pg" psql -X -q -tA -U postgres -d mnemo -c "$1"; }
# The runbook as the tables' owner, as the migrate service and the workers connect: the server's
# own role is the API's, which row-level security holds and the runbook refuses.
runbook() {
  "${docker[@]}" exec -e MNEMO_DATABASE_URL=postgres://mnemo:mnemo@postgres:5432/mnemo "$server" mnemo-runbook "$@"
}
tenant="compose-test"

up() {
  local t0=$SECONDS out
  out=$(dc up -d --no-build --scale worker=2 2>&1) || { echo "$out" >&2; fail "docker-compose up"; exit 1; }
  for _ in $(seq 120); do curl -sf "$api/readyz" >/dev/null && break; sleep 1; done
  curl -sf "$api/readyz" >/dev/null || { fail "the API answers /readyz on 127.0.0.1:$MNEMO_API_PORT"; exit 1; }
  pass "stack up, API ready on 127.0.0.1:$MNEMO_API_PORT in $((SECONDS - t0)) s"
  pg=$(dc ps -q postgres) server=$(dc ps -q server)
}

# Waits up to $1 s for every row to have its vector and the embed queue to settle; prints seconds.
settled() {
  local t0=$SECONDS s
  while [ $((SECONDS - t0)) -lt "$1" ]; do
    s=$(runbook status --json)
    if jq -e '.embeddings.pending == 0 and .embeddings.failed == 0
              and ([.queues[] | select(.queue == "embed") | .pending + .running] | add // 0) == 0' \
      <<<"$s" >/dev/null; then
      echo $((SECONDS - t0)); return 0
    fi
    sleep 1
  done
  echo "$s" >&2; return 1
}

# --- 1. write, embed, recall ------------------------------------------------------------------
log "bringing up the stack (compose: ${compose[*]})"
dc down -v --remove-orphans >/dev/null 2>&1 || true
up
ports=$(for c in $(dc ps -q); do "${docker[@]}" port "$c"; done)
if [ "$ports" = "8080/tcp -> 127.0.0.1:$MNEMO_API_PORT" ]; then pass "only the API is published, on 127.0.0.1 ($ports)"
else fail "published ports: $ports"; fi
[ "$(dc ps -q worker | wc -l)" = 2 ] && pass "two workers running" || fail "two workers running"
users=$(for c in $server $(dc ps -q worker); do "${docker[@]}" exec "$c" id -u; done | sort -u)
[ "$users" = 10001 ] && pass "the server and workers run as uid 10001, not root" || fail "users: $users"
for _ in $(seq 30); do
  health=$("${docker[@]}" inspect -f '{{.State.Health.Status}}' "$server")
  [ "$health" = healthy ] && break
  sleep 1
done
[ "$health" = healthy ] && pass "the server's healthcheck reads /readyz" || fail "server health: $health"

token=$(runbook token --tenant "$tenant" --user alice --agent helper --session s1)
i=0
for text in "I moved to Paris last spring." "I work at a bakery near the canal." "My sister lives in Lyon."; do
  i=$((i + 1))
  post /v1/memories <<<"{\"source_kind\":\"chat_message\",\"source_ref\":\"msg-$i\",\"content\":\"$text\"}" >/dev/null
done
post /v1/facts <<<'{"content":"Alice lives in Paris","scope":"user","key":"home_city"}' >/dev/null
if s=$(settled 60); then pass "4 rows written through the API, embedded in ${s} s"; else fail "4 rows embedded within 60 s"; fi
recall() { post /v1/recall <<<'{"query":"where does alice live","top_k":5}'; }
first=$(recall)
if jq -e '.degraded == false and ([.items[].source_ref] | index("msg-1") != null)
          and ([.items[].content] | index("Alice lives in Paris") != null)' <<<"$first" >/dev/null; then
  pass "recall finds the message and the fact, not degraded"
else
  fail "recall: $first"
fi

# --- 2. down and up, volume kept --------------------------------------------------------------
log "down and up again, the volume kept"
dc down >/dev/null 2>&1
up
again=$(recall)
if [ "$(jq -c '[.items[] | {id, content}]' <<<"$again")" = "$(jq -c '[.items[] | {id, content}]' <<<"$first")" ] &&
  jq -e '.degraded == false' <<<"$again" >/dev/null; then
  pass "after down and up: the same $(jq '.items | length' <<<"$again") rows recalled, not degraded"
else
  fail "after down and up: $again"
fi

# --- 3. a worker killed mid-batch -------------------------------------------------------------
rows=1000
log "writing $rows rows, then killing the worker that holds embed jobs"
# Document chunks are the service's to write: a token without a user or a session.
token=$(runbook token --tenant "$tenant" --agent helper)
body=$(jq -nc --argjson n "$rows" '{items: [range($n) | {source_kind: "document_chunk", source_ref: "doc-\(.)",
  content: "Document \(.) of the compose test: notes on topic \(. % 37), shelf \(. % 11), written for the worker kill."}]}')
t0=$SECONDS
written=$(post /v1/memories/batch <<<"$body" | jq '.written')
[ "$written" = "$rows" ] && pass "$rows rows written in one batch" || fail "batch wrote $written of $rows rows"
victim="" held=""
for _ in $(seq 100); do
  # The worker holding the most: a worker's name is mnemo-{host}-…, and its host name is its
  # container id's first 12 characters.
  busiest=$(sql "SELECT split_part(lock_by, '-', 2), string_agg(id::text, ',') FROM apalis.jobs
                 WHERE job_type = 'embed' AND status = 'Running' GROUP BY 1 ORDER BY count(*) DESC LIMIT 1")
  if [ -n "$busiest" ]; then
    for c in $(dc ps -q worker); do if [ "${c:0:12}" = "${busiest%%|*}" ]; then victim=$c; fi; done
    held=${busiest#*|}
    break
  fi
  sleep 0.1
done
if [ -z "$victim" ]; then
  fail "a worker holding embed jobs was found"
else
  "${docker[@]}" kill "$victim" >/dev/null
  pending=$(runbook status --json | jq '.embeddings.pending')
  njobs=$(tr ',' '\n' <<<"$held" | wc -l)
  pass "killed worker ${victim:0:12} holding $njobs running embed jobs, $((SECONDS - t0)) s after the write; $pending rows not yet embedded"
  if s=$(settled 300); then pass "every row embedded and the queue settled $((SECONDS - t0)) s after the write (${s} s after the kill)"
  else fail "rows embedded within 300 s of the kill"; fi
  [ "$("${docker[@]}" inspect -f '{{.State.Running}}' "$victim")" = false ] &&
    pass "the killed worker stayed down: the other did the work" || fail "the killed worker was restarted"
  ids=$(sed "s/[^,]\+/'&'/g" <<<"$held")
  done_jobs=$(sql "SELECT count(*) FROM apalis.jobs WHERE id IN ($ids) AND status = 'Done'")
  [ "$done_jobs" = "$njobs" ] && pass "the killed worker's $njobs jobs are done" ||
    fail "of the killed worker's $njobs jobs, $done_jobs are done"
  counts=$(sql "SELECT (SELECT count(*) FROM memory_items WHERE tenant_id = '$tenant'),
                       (SELECT count(DISTINCT item_id) FROM memory_embeddings WHERE tenant_id = '$tenant'),
                       (SELECT count(*) FROM memory_embeddings WHERE tenant_id = '$tenant')")
  [ "$counts" = "$((rows + 4))|$((rows + 4))|$((rows + 4))" ] &&
    pass "$((rows + 4)) rows, each with one vector" || fail "rows|rows with a vector|vectors: $counts"
fi
