#!/usr/bin/env bash
# The full-text index with and without the tenant beside the lexemes (migration 48), on a scratch
# database migrated by mnemo that holds recall-throughput's 2,000 LoCoMo turns (tenant 'bench',
# session 'locomo'). Usage, each step as docs/benchmarks.md ran it:
#   docs/analysis/tenant_text_index.sh DB neighbour   # once: 400,000 rows of a tenant 'noisy' (100 sessions)
#   docs/analysis/tenant_text_index.sh DB read        # the keyword statement for 'bench', generic plan, twice each way
#   docs/analysis/tenant_text_index.sh DB fresh       # 20,000 new rows entering the index in batches of 32
#   docs/analysis/tenant_text_index.sh DB reenter     # 40,000 of the neighbour's rows leaving and re-entering it
# Connects as psql's environment says (PGHOST, PGPORT, PGUSER, PGPASSWORD). Leaves the index as built.
set -euo pipefail
db=$1
P="psql -d $db -qAt"
PRED="WHERE deleted_at IS NULL AND anonymized_at IS NULL AND embedded_model IS NOT NULL"
lexemes_only() {
  $P -c "DROP INDEX IF EXISTS memory_items_tenant_text_idx" -c "DROP INDEX IF EXISTS memory_items_tsv_idx" \
     -c "CREATE INDEX memory_items_tsv_idx ON memory_items USING rum (tsv rum_tsvector_ops) $PRED" -c "ANALYZE memory_items"
}
with_tenant() {
  $P -c "DROP INDEX IF EXISTS memory_items_tsv_idx" -c "DROP INDEX IF EXISTS memory_items_tenant_text_idx" \
     -c "CREATE INDEX memory_items_tenant_text_idx ON memory_items USING rum (tenant_id rum_text_ops, tsv rum_tsvector_ops) $PRED" \
     -c "ANALYZE memory_items"
}
read_bench() {
  # The class branch's shape (session class, LIMIT 200 by RUM's distance) with a generic plan, as
  # PostgreSQL plans a prepared statement after its fifth execution; the median of 11.
  $P <<SQL | grep -o "Execution Time: [0-9.]*" | awk '{print $3}' | sort -n |
SET plan_cache_mode = force_generic_plan;
PREPARE k(text, text, tsquery) AS SELECT m.id FROM memory_items m WHERE m.tenant_id = \$1 AND m.scope = 'session' AND m.session_id = \$2 AND m.deleted_at IS NULL AND m.anonymized_at IS NULL AND m.embedded_model IS NOT NULL AND m.tsv @@ \$3 ORDER BY m.tsv <=> \$3 LIMIT 200;
$(for _ in $(seq 1 11); do echo "EXPLAIN (ANALYZE, TIMING OFF) EXECUTE k('bench', 'locomo', 'potteri | class');"; done)
SQL
    awk '{a[NR]=$1} END {printf "median %.2f ms (min %.2f, max %.2f) of %d\n", a[int((NR+1)/2)], a[1], a[NR], NR}'
}
fresh_rows() {  # $1: a session name not used before
  $P -c "INSERT INTO memory_items (id, tenant_id, scope, session_id, source_kind, source_ref, content, content_sha256, event_time, role)
         SELECT gen_random_uuid(), 'noisy', 'session', '$1', 'chat_message', '$1-' || g || '-' || m.id, 'pottery class ' || m.content,
                m.content_sha256, m.event_time, m.role
         FROM memory_items m, generate_series(1, 10) g WHERE m.tenant_id = 'bench'" -c "CHECKPOINT"
  # As the embed worker does: batches of 32 rows, one statement each, in the order written.
  $P -c "\timing on" -c "DO \$\$ DECLARE ids uuid[]; BEGIN
     FOR ids IN SELECT array_agg(id) FROM (SELECT id, (row_number() OVER (ORDER BY ctid) - 1) / 32 AS b
                FROM memory_items WHERE tenant_id = 'noisy' AND session_id = '$1') x GROUP BY b ORDER BY b LOOP
       UPDATE memory_items SET embedded_model = 'all-MiniLM-L6-v2' WHERE tenant_id = 'noisy' AND id = ANY(ids);
     END LOOP; END \$\$" | grep Time
}
reenter() {
  local sessions="session_id IN ('s1','s2','s3','s4','s5','s6','s7','s8','s9','s10')"
  $P -c "UPDATE memory_items SET embedded_model = NULL WHERE tenant_id = 'noisy' AND $sessions" -c "VACUUM memory_items" -c "CHECKPOINT"
  $P -c "\timing on" -c "UPDATE memory_items SET embedded_model = 'all-MiniLM-L6-v2' WHERE tenant_id = 'noisy' AND $sessions" | grep Time
}
case $2 in
  neighbour)
    $P -c "INSERT INTO memory_items (id, tenant_id, scope, session_id, source_kind, source_ref, content, content_sha256, event_time, embedded_model, role)
           SELECT gen_random_uuid(), 'noisy', 'session', 's' || (g % 100), 'chat_message', 'r' || g || '-' || m.id, 'pottery class ' || m.content,
                  m.content_sha256, m.event_time, m.embedded_model, m.role
           FROM memory_items m, generate_series(1, 200) g WHERE m.tenant_id = 'bench'" -c "VACUUM ANALYZE memory_items" ;;
  read)    for round in 1 2; do lexemes_only; echo "round $round, lexemes only: $(read_bench)"; with_tenant; echo "round $round, tenant and lexemes: $(read_bench)"; done ;;
  fresh)   for round in 1 2; do lexemes_only; echo "round $round, lexemes only: $(fresh_rows "a$round-$RANDOM")"; with_tenant; echo "round $round, tenant and lexemes: $(fresh_rows "b$round-$RANDOM")"; done ;;
  reenter) for round in 1 2; do lexemes_only; echo "round $round, lexemes only: $(reenter)"; with_tenant; echo "round $round, tenant and lexemes: $(reenter)"; done ;;
  *) echo "unknown step $2" >&2; exit 2 ;;
esac
