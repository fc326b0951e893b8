"""`consumer-idem list` and `stats` as an operator runs them: filters, pages, and output that
never truncates a scope or key (a real subprocess, the real database)."""

from __future__ import annotations

import json
import uuid

import asyncpg

from consumer_idem import PostgresStore
from tests._cli import TERMINAL, cli

FP = "v1:jcs:x"


async def parked(store: PostgresStore, scope: str, key: str, why: str = "gateway timeout") -> None:
    d = await store.reserve(scope, key, FP)
    await store.mark_unknown(scope, key, d.token, why)


async def completed(store: PostgresStore, scope: str, key: str) -> None:
    d = await store.reserve(scope, key, FP)
    await store.complete(scope, key, d.token, {"ok": True})


def first_column(table: str) -> str:
    """The first column's text of a rich table, its folded pieces joined."""
    cells = [line.split("│")[1].strip() for line in table.splitlines() if line.startswith("│")]
    return "".join(cells)


async def test_list_finds_stuck_keys_by_status_scope_and_age(
    pg_dsn: str, pg_pool: asyncpg.Pool, store: PostgresStore
) -> None:
    prefix = f"cli-ls-{uuid.uuid4().hex[:8]}"
    await parked(store, f"{prefix}.pay", "old-1")
    await parked(store, f"{prefix}.pay", "new-1")
    await completed(store, f"{prefix}.pay", "done-1")
    await parked(store, f"{prefix}.other", "x")
    await pg_pool.execute(
        f"UPDATE {store.table} SET updated_at = now() - interval '3 hours' WHERE key = 'old-1'"
        " AND scope = $1",
        f"{prefix}.pay",
    )

    code, out, err = await cli(
        "list", "--status", "unknown", "--scope", f"{prefix}.pay", "--json", dsn=pg_dsn
    )
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["key"], r["status"]) for r in rows] == [("old-1", "unknown"), ("new-1", "unknown")]
    assert rows[0]["last_error"] == "gateway timeout" and rows[0]["age_s"] > 3 * 3600 - 60

    code, out, _ = await cli(
        "list", "--status", "unknown", "--scope", prefix, "--older-than", "1h", "--json", dsn=pg_dsn
    )
    assert code == 0 and [json.loads(line)["key"] for line in out.splitlines()] == ["old-1"]

    code, out, _ = await cli("list", "--scope", prefix, dsn=pg_dsn)  # the table
    assert code == 0
    lines = out.splitlines()
    header = "".join(lines[1].split()).split("┃")
    assert header == ["", "scope", "key", "status", "attempts", "age", "lasterror", ""]
    assert sum(f"{prefix}.pay" in line for line in lines) == 3
    assert any("old-1" in line and "3h0" in line and "gateway timeout" in line for line in lines)

    code, out, err = await cli("list", "--scope", f"{prefix}.none", dsn=pg_dsn)
    assert code == 0 and out == "" and "no keys match" in err


async def test_list_pages_with_the_cursor_it_prints(pg_dsn: str, store: PostgresStore) -> None:
    scope = f"cli-page-{uuid.uuid4().hex[:8]}"
    for i in range(7):
        await completed(store, scope, f"k{i}")
    seen: list[str] = []
    args: tuple[str, ...] = ("list", "--scope", scope, "--limit", "3", "--json")
    pages = 0
    while True:
        code, out, err = await cli(*args, dsn=pg_dsn)
        assert code == 0, err
        pages += 1
        rows = [json.loads(line) for line in out.splitlines()]
        seen += [r["key"] for r in rows]
        if "next page:" not in err:
            break
        # the hint names the same filters and the next cursor, which is the last row's own
        cursor = err.split("--after ")[1].split()[0]
        assert cursor == rows[-1]["cursor"] and f"--scope {scope}" in err
        args = ("list", "--scope", scope, "--limit", "3", "--json", "--after", cursor)
    assert pages == 3 and seen == [f"k{i}" for i in range(7)]

    code, out, _ = await cli("list", "--scope", scope, "--limit", "5", dsn=pg_dsn)
    assert code == 0 and "next page: consumer-idem list --scope" in out and "--after " in out


async def test_list_and_stats_never_cut_a_long_scope_or_key(
    pg_dsn: str, store: PostgresStore
) -> None:
    scope = f"cli-wide-{uuid.uuid4().hex[:8]}." + "tenant-" * 15
    key = "order-" + "x" * 150
    await parked(store, scope, key)

    code, out, _ = await cli("list", "--scope", scope, dsn=pg_dsn)  # a pipe: full lines
    assert code == 0 and "…" not in out
    assert any(scope in line and key in line for line in out.splitlines())
    code, out, _ = await cli("stats", "--scope", scope, dsn=pg_dsn)
    assert code == 0 and "…" not in out and any(scope in line for line in out.splitlines())

    narrow = dict(TERMINAL, COLUMNS="60")  # a narrow terminal: cells fold, nothing is cut
    code, out, _ = await cli("list", "--scope", scope, dsn=pg_dsn, **narrow)
    assert code == 0 and "…" not in out
    assert first_column(out.split("┡")[1]) == scope
    code, out, _ = await cli("stats", "--scope", scope, dsn=pg_dsn, **narrow)
    assert code == 0 and "…" not in out
    assert first_column(out.split("┡")[1]) == scope


async def test_list_bad_input_is_one_line_and_exit_2(pg_dsn: str) -> None:
    for args, words in [
        (("list", "--status", "stuck"), "'stuck' is not one of"),
        (("list", "--older-than", "soon"), "is not a duration"),
        (("list", "--after", "garbage"), "invalid cursor"),
        (("list", "--limit", "0"), "--limit"),
    ]:
        code, out, err = await cli(*args, dsn=pg_dsn)
        assert code == 2 and out == "", (args, out, err)
        assert err.startswith("error: ") and words in err and err.count("\n") == 1, err
