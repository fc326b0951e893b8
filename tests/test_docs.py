"""The docs site's code is tested code.

* Every Python block of a page is an include (``--8<-- "docs/snippets/x.py"``) of a file, never
  inline code, so a wrong snippet cannot sneak in; every include resolves, sections too.
* Every program in ``docs/snippets/`` runs against the real services and exits 0 (each asserts
  what its page claims), and the quickstart prints what its page shows.
* Shell lines name commands that exist: each ``consumer-idem ...`` line parses (with
  ``--help``), each ``make X`` is a target, each local module a command names is a file.
* The README's quickstart is the quickstart program, verbatim.

``make docs`` (part of ``make test``) builds the site with ``--strict``.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import html
import os
import re
import shlex
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"
PAGES = sorted(p for p in DOCS.rglob("*.md") if SNIPPETS not in p.parents)
PROGRAMS = sorted(SNIPPETS.glob("*.py"))

FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```", re.S | re.M)
INCLUDE = re.compile(r'^--8<-- "([^"]+)"$')
PYTHON = {"python", "py", "python3", "pycon"}
SHELL = {"sh", "bash", "shell", "console"}


def blocks(text: str) -> Iterator[tuple[str, str]]:
    """(language, body) of each fenced block."""
    for match in FENCE.finditer(text):
        yield match[1].lower(), match[2]


def includes(text: str) -> Iterator[str]:
    for lang, body in blocks(text):
        if lang in PYTHON:
            for line in body.splitlines():
                if INCLUDE.match(line.strip()):
                    yield INCLUDE.match(line.strip())[1]  # type: ignore[index]
    for line in text.splitlines():  # an include outside a block (contributing.md)
        if INCLUDE.match(line):
            yield INCLUDE.match(line)[1]  # type: ignore[index]


# --- pages -----------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_python_block_of_a_page_is_an_include(page: Path) -> None:
    for lang, body in blocks(page.read_text()):
        if lang in PYTHON:
            lines = [line.strip() for line in body.splitlines() if line.strip()]
            assert lines and all(INCLUDE.match(line) for line in lines), (
                f"{page.relative_to(ROOT)} holds Python that is not an include of a tested "
                f'file: put it in docs/snippets/ and include it with --8<-- "path":\n{body}'
            )


def test_every_include_resolves_with_its_section() -> None:
    seen = 0
    for page in PAGES:
        for ref in includes(page.read_text()):
            path, _, section = ref.partition(":")
            target = ROOT / path
            assert target.is_file(), f"{page.name}: {path} does not exist"
            if section:
                text = target.read_text()
                for edge in ("start", "end"):
                    assert f"--8<-- [{edge}:{section}]" in text, f"{ref}: no {edge} marker"
            seen += 1
    assert seen > 20  # the check ran over the real pages


def test_every_snippet_program_is_shown_on_a_page() -> None:
    shown = {ref.partition(":")[0] for page in PAGES for ref in includes(page.read_text())}
    for program in PROGRAMS:
        assert str(program.relative_to(ROOT)) in shown, f"{program.name} is on no page"


# --- the programs ----------------------------------------------------------------------------


#: the programs that need a service besides PostgreSQL (each test below takes that service's
#: fixture, so a service that does not answer fails the test, naming it)
KAFKA = {"kafka.py", "faststream_app.py", "faststream_batch.py", "faststream_confluent.py"}
RABBIT = {"rabbitmq.py", "outbox.py"}
REDIS = {"redis_cache.py", "redis_store.py", "faststream_redis.py", "faststream_redis_batch.py"}
NATS = {"faststream_nats.py"}


def programs(names: set[str] | None) -> list[Any]:
    chosen = [
        p
        for p in PROGRAMS
        if (p.name in names if names is not None else p.name not in KAFKA | RABBIT | REDIS | NATS)
    ]
    return [pytest.param(p, id=p.name) for p in chosen]


async def run(program: Path, pg_dsn: str, settings: Any, name: str) -> None:
    """Run the program as a user would (``python docs/snippets/x.py``), with the services'
    settings and a topic and queue of its own (``name``: a concurrent run never shares them),
    for at most a minute; it must exit 0."""
    env = {
        **os.environ,
        "CONSUMER_IDEM_PG_DSN": pg_dsn,
        "CONSUMER_IDEM_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "CONSUMER_IDEM_AMQP_URL": settings.amqp_url,
        "CONSUMER_IDEM_REDIS_URL": settings.redis_url,
        "CONSUMER_IDEM_NATS_URL": settings.nats_url,
        "DOCS_TOPIC": name,
        "DOCS_QUEUE": name,
    }
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(program)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"{program.name} failed:\n{result.stdout}\n{result.stderr}"
    if program.name == "quickstart.py":
        page = (DOCS / "quickstart.md").read_text()
        shown = next(body for lang, body in blocks(page) if lang == "text")
        assert result.stdout == shown, "the quickstart page shows another output"


def fresh_name() -> str:
    return f"docs-{uuid.uuid4().hex[:10]}"


@pytest.mark.parametrize("program", programs(None))
async def test_the_program_runs(program: Path, pg_dsn: str, settings: Any) -> None:
    await run(program, pg_dsn, settings, fresh_name())


@pytest.mark.parametrize("program", programs(KAFKA))
async def test_the_kafka_program_runs(
    program: Path, pg_dsn: str, settings: Any, kafka_admin: Any
) -> None:
    name = fresh_name()
    try:
        await run(program, pg_dsn, settings, name)
    finally:
        with contextlib.suppress(Exception):  # never created when the program failed early
            await kafka_admin.delete_topics([name, f"{name}.recorded"])


@pytest.mark.parametrize("program", programs(RABBIT))
async def test_the_rabbitmq_program_runs(
    program: Path, pg_dsn: str, settings: Any, amqp_connection: Any
) -> None:
    name = fresh_name()
    try:
        await run(program, pg_dsn, settings, name)
    finally:
        channel = await amqp_connection.channel()
        for queue in (name, f"{name}.dlq", f"{name}.booked"):
            await channel.queue_delete(queue)
        await channel.close()


@pytest.mark.parametrize("program", programs(REDIS))
async def test_the_redis_program_runs(
    program: Path, pg_dsn: str, settings: Any, redis_client: Any
) -> None:
    await run(program, pg_dsn, settings, fresh_name())


@pytest.mark.parametrize("program", programs(NATS))
async def test_the_nats_program_runs(
    program: Path, pg_dsn: str, settings: Any, nats_url: str
) -> None:
    import nats

    name = fresh_name()
    try:
        await run(program, pg_dsn, settings, name)
    finally:
        client = await nats.connect(nats_url)
        with contextlib.suppress(Exception):  # never created when the program failed early
            await client.jsm().delete_stream(name)
        await client.close()


def test_every_program_is_run() -> None:
    assert len(programs(None)) + len(KAFKA | RABBIT | REDIS | NATS) == len(PROGRAMS)


# --- shell lines -----------------------------------------------------------------------------


def shell_lines() -> Iterator[tuple[str, str]]:
    """(where, command line) of every shell block of the pages and the README."""
    for doc in [*PAGES, ROOT / "README.md", ROOT / "CONTRIBUTING.md"]:
        for lang, body in blocks(doc.read_text()):
            if lang not in SHELL:
                continue
            joined = re.sub(r"\\\n\s*", " ", body)
            for line in joined.splitlines():
                line = line.strip()
                if lang == "console":
                    if not line.startswith("$ "):
                        continue  # output
                    line = line[2:]
                if line and not line.startswith("#"):
                    yield doc.name, line


def words(line: str) -> list[str]:
    return shlex.split(line, comments=True)


def parse_cli(argv: list[str]) -> None:
    """Parse a ``consumer-idem`` command line as the command would (every option, type and
    required argument), without running it."""
    import typer.main

    from consumer_idem.cli.app import app

    group = typer.main.get_command(app)
    ctx = group.make_context("consumer-idem", list(argv))
    # the subcommand's words: click 8.2+ (and typer's own copy) keep them as _protected_args
    words = getattr(ctx, "_protected_args", None)
    if words is None:
        words = ctx.protected_args
    name, command, rest = group.resolve_command(ctx, [*words, *ctx.args])
    assert command is not None, f"no command {name}"
    command.make_context(name, rest, parent=ctx)


def test_every_consumer_idem_command_line_parses() -> None:
    checked = 0
    for where, line in shell_lines():
        argv = words(line)
        if not argv or argv[0] != "consumer-idem":
            continue
        try:
            parse_cli(argv[1:])
        except Exception as exc:
            pytest.fail(f"{where}: `{line}` does not parse: {type(exc).__name__}: {exc}")
        checked += 1
    assert checked >= 8


def test_the_command_line_check_can_fail() -> None:
    for wrong in (["prune", "--policy", "sometimes"], ["list", "--colour"], ["evict"], ["nope"]):
        with pytest.raises(Exception):  # noqa: B017 (click's usage errors have no common import)
            parse_cli(wrong)


def test_every_make_target_and_local_module_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):", makefile, re.M))
    checked = 0
    for where, line in shell_lines():
        argv = words(line)
        if argv and argv[0] == "make":
            for target in argv[1:]:
                assert target in targets, f"{where}: `make {target}` is not a target"
                checked += 1
        for module in re.findall(r"\b((?:examples|handlers|benchmarks)(?:\.\w+)+)", line):
            path = ROOT / module.replace(".", "/")
            assert path.with_suffix(".py").is_file() or path.is_dir(), f"{where}: {module}?"
            checked += 1
        if argv and argv[0].startswith("scripts/"):
            assert (ROOT / argv[0]).is_file(), f"{where}: {argv[0]} does not exist"
    assert checked >= 4


# --- the README ------------------------------------------------------------------------------


def test_the_readme_quickstart_is_the_tested_program() -> None:
    readme = (ROOT / "README.md").read_text()
    python = [body for lang, body in blocks(readme) if lang in PYTHON]
    assert python, "the README shows no quickstart"
    assert python[0] == (SNIPPETS / "quickstart.py").read_text()


def test_the_readme_holds_no_other_python() -> None:
    """Only the quickstart: code of every other kind lives on the site, tested."""
    readme = (ROOT / "README.md").read_text()
    quickstart = (SNIPPETS / "quickstart.py").read_text()
    untested = [body for lang, body in blocks(readme) if lang in PYTHON and body != quickstart]
    assert untested == [], "the README holds Python that no test runs"


def test_the_readme_is_a_landing_page_with_links_into_the_repository() -> None:
    """At most 150 lines, and every link resolves here: to a file of the repository (the docs
    site is not published), or to an anchor of a page."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert len(links) > 15
    for link in links:
        assert not link.startswith("http"), f"README links outside the repository: {link}"
        assert (ROOT / link.partition("#")[0]).exists(), f"README links to a missing {link}"


def test_no_file_links_to_the_unpublished_docs_site() -> None:
    site = "consumer-idem.github." + "io"  # spelled apart: this file is searched too
    hits = [
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*")
        if path.is_file()
        and not {".git", ".venv", "site", "dist", ".mypy_cache"} & set(path.relative_to(ROOT).parts)
        and path.suffix in {".md", ".py", ".toml", ".yml", ".yaml", ".cfg", ".txt", ""}
        and site in path.read_text(errors="replace")
    ]
    assert hits == [], f"links to {site}, which does not resolve: {hits}"


# --- the rendered site -----------------------------------------------------------------------

#: the width of the rendered code column, in characters (beyond it a line is clipped)
CODE_COLUMN = 80
RENDERED_BLOCK = re.compile(
    r'<div class="language-([\w+-]+) highlight"><pre>(?:<span></span>)?<code>(.*?)</code></pre>',
    re.S,
)


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as ``make docs`` builds it (``--strict``), in a folder of this session's."""
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"
    return out


def rendered_pages(site: Path) -> list[Path]:
    """The HTML of each page written in docs/ (the API reference aside: it is generated)."""
    pages = [
        site / page.relative_to(DOCS).with_suffix("") / "index.html"
        if page.name != "index.md"
        else site / page.relative_to(DOCS).parent / "index.html"
        for page in PAGES
        if "reference" not in page.relative_to(DOCS).parts
    ]
    assert len(pages) > 20 and all(page.is_file() for page in pages)
    return pages


def rendered_blocks(page: Path) -> Iterator[tuple[str, str]]:
    """(language, text) of each code block of a rendered page, as a reader copies it."""
    for match in RENDERED_BLOCK.finditer(page.read_text()):
        yield match[1], html.unescape(re.sub(r"<[^>]+>", "", match[2]))


def names_missing(sources: list[str]) -> set[str]:
    """Names the code uses that none of ``sources`` imports, defines or binds, nor Python
    itself (a reader pasting every block of the page in order would meet a NameError)."""
    bound: set[str] = set(dir(builtins))
    used: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(textwrap.dedent(source))):
            if isinstance(node, ast.Name):
                (bound if isinstance(node.ctx, ast.Store | ast.Del) else used).add(node.id)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bound.add(node.name)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, ast.alias):
                bound.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.ExceptHandler) and node.name:
                bound.add(node.name)
    return used - bound


def test_the_name_check_finds_a_missing_import() -> None:
    assert names_missing(["broker = KafkaBroker(BOOTSTRAP)"]) == {"KafkaBroker", "BOOTSTRAP"}
    assert names_missing(["import os\n", "x = os.environ\nfor k in x: print(k)"]) == set()


def test_every_rendered_page_holds_the_imports_its_code_uses(site: Path) -> None:
    checked = 0
    for page in rendered_pages(site):
        python = [text for lang, text in rendered_blocks(page) if lang in PYTHON]
        missing = names_missing(python)
        assert not missing, (
            f"{page.relative_to(site)}: its code uses {sorted(missing)}, which no block of "
            "the page imports or defines: pasted as shown, it fails with a NameError "
            "(start the included section at the file's imports)"
        )
        checked += len(python)
    assert checked > 20


def test_no_rendered_code_line_is_wider_than_the_code_column(site: Path) -> None:
    wide = [
        f"{page.relative_to(site)}: {len(line)} characters: {line}"
        for page in rendered_pages(site)
        for lang, text in rendered_blocks(page)
        if lang in PYTHON or lang in {"sh", "bash", "shell"}  # code; output may scroll
        for line in text.splitlines()
        if len(line) > CODE_COLUMN
    ]
    assert wide == [], "clipped at the rendered code column:\n" + "\n".join(wide)


def test_the_api_reference_renders_cross_references_as_links(site: Path) -> None:
    """Docstrings cross-reference with mkdocstrings' [`name`][identifier], rendered as a link;
    a Sphinx role (:class:`X`) would show as raw text."""
    role = re.compile(r":(?:py:)?(?:meth|func|class|attr|exc|mod|data|obj):`[^`]*`")
    pages = sorted((site / "reference").rglob("index.html"))
    assert len(pages) >= 10
    raw = [
        f"{page.relative_to(site)}: {found}"
        for page in pages
        for found in role.findall(html.unescape(re.sub(r"<[^>]+>", "", page.read_text())))
    ]
    assert raw == [], "raw roles in the API reference:\n" + "\n".join(raw)
    links = sum(page.read_text().count('class="autorefs autorefs-internal"') for page in pages)
    assert links > 150  # the docstrings' cross-references, as links
