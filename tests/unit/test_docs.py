"""The documentation: the generated reference pages are current, the site builds with `mkdocs build --strict` (no
broken link or anchor, no page left out of the navigation, nothing downloaded), every error code has a meaning,
benchmark results are well-formed, and the pages read as a manual (no history) with a short README."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from core.protocol import ErrorCode
from tests.conftest import ROOT
from trainserve import docs_reference


def _clean_env() -> dict[str, str]:
    """The environment without TRAINSERVE_* settings (a test run sets some; the pages use the defaults)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSERVE_")}
    return {**env, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "NO_MKDOCS_2_WARNING": "1"}


def test_generated_reference_pages_are_current():
    # A fresh process: the OpenAPI document must not include job kinds other tests registered in this one.
    done = subprocess.run([sys.executable, "-m", "trainserve.docs_reference", "--check"], cwd=ROOT,
                          env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_site_builds_strict_and_offline(tmp_path: Path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for page in ("index.html", "getting-started/index.html", "reference/configuration/index.html",
                 "reference/http-api/index.html", "reference/error-codes/index.html", "benchmarks/results/index.html"):
        assert (site / page).is_file(), page
    home = (site / "index.html").read_text()
    assert "fonts.googleapis.com" not in home and "fonts.gstatic.com" not in home  # theme.font: false


def test_stale_page_is_reported(tmp_path: Path):
    page = tmp_path / "configuration.md"
    page.write_text("old\n")
    rendered = {page: docs_reference.configuration_page()}
    assert docs_reference.stale(rendered) == [page]
    page.write_text(rendered[page])
    assert docs_reference.stale(rendered) == []


def test_a_record_is_stale_from_the_first_commit_that_changes_what_it_measures(tmp_path: Path):
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "bench@example.com")
    git("config", "user.name", "bench")
    (tmp_path / "engine").mkdir()
    for path in ("engine/kernel.py", "docs.md"):
        (tmp_path / path).write_text("v1\n")
    git("add", "-A")
    git("commit", "-qm", "measured")
    record = docs_reference.BenchmarkResult(
        benchmark="bench/x.py", what="x", command="python bench/x.py", date="2026-12-06", machine="m", load="1.0",
        result="2x", commit=git("rev-parse", "--short", "HEAD"), measures=["bench/x.py", "engine"])
    (tmp_path / "docs.md").write_text("v2\n")  # a commit that leaves the measured code alone
    git("commit", "-qam", "docs")
    assert docs_reference.freshness(record, tmp_path) == "current"
    (tmp_path / "engine" / "kernel.py").write_text("v2\n")
    git("commit", "-qam", "faster kernel")
    first = git("rev-parse", "HEAD")[:9]
    (tmp_path / "engine" / "kernel.py").write_text("v3\n")
    git("commit", "-qam", "faster still")
    assert docs_reference.freshness(record, tmp_path).startswith(f"stale: the measured code changed in {first} ")
    unknown = record.model_copy(update={"commit": "0" * 40})
    assert docs_reference.freshness(unknown, tmp_path).startswith("unknown")


@pytest.mark.skipif(not docs_reference.has_history(), reason="a shallow clone cannot tell what changed since a record")
def test_every_benchmark_record_measures_todays_code():
    # The results page lists only figures of the code they name: a record whose measured code a later commit changed
    # is measured again or removed (docs/benchmarks/index.md#recording-a-result).
    stale = [f"{name}: {state}" for name, result in docs_reference.load_results(docs_reference.RESULTS)
             if (state := docs_reference.freshness(result)) != "current"]
    assert not stale, "measure again or remove:\n" + "\n".join(stale)


def test_configuration_page_lists_every_setting_with_type_and_default():
    from core.settings import Settings

    text = docs_reference.configuration_page()
    for name in Settings.model_fields:
        assert f"`TRAINSERVE_{name.upper()}`" in text, name
    assert "| `TRAINSERVE_DB_POOL_SIZE` | `int` (>= 1) | `5` |" in text
    assert "| `TRAINSERVE_MAX_UPLOAD_BYTES` | `int` | `104857600` (100 MiB) |" in text
    assert "&lt;home>" in text  # `<home>` in a description stays text, not an HTML tag


def test_http_api_page_renders_operations_and_schemas():
    document = {
        "openapi": "3.1.0", "info": {"title": "t", "version": "1", "description": "D."},
        "paths": {"/things/{id}": {"get": {
            "tags": ["things"], "summary": "Read Thing", "description": "One thing.", "security": [{"b": []}],
            "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}},
                           {"name": "limit", "in": "query", "schema": {"type": "integer", "maximum": 100}}],
            "responses": {"200": {"description": "OK", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Thing"}}}}}}}},
        "components": {"schemas": {"Thing": {"type": "object", "description": "A thing.", "required": ["id"],
                                             "properties": {"id": {"type": "string"},
                                                            "tags": {"type": "array", "items": {"type": "string"},
                                                                     "default": []},
                                                            "kind": {"anyOf": [{"enum": ["a", "b"]},
                                                                               {"type": "null"}]}}}}},
    }
    text = docs_reference.http_api_page(document)
    assert "### GET /things/{id}" in text and "**Read Thing**: One thing." in text
    assert "| `limit` | query | integer (&lt;= `100`) |  |  |  |" in text  # `<` as an entity outside code
    assert "| `200` | [Thing](#thing) | OK |" in text
    assert "| `tags` | array of string |  | `[]` |  |" in text
    assert '| `kind` | `"a"` or `"b"` or null |' in text


def test_every_error_code_has_a_meaning_and_no_entry_is_stray():
    meanings = docs_reference.error_meanings()
    assert set(meanings) == {code.value for code in ErrorCode}
    assert all(status and meaning.endswith(".") for status, meaning in meanings.values())


def test_benchmark_results_are_well_formed():
    results = docs_reference.load_results(docs_reference.RESULTS)
    assert results, "bench/results/ holds the measured results"
    scripts = {path.name for path in (ROOT / "bench").glob("*.py")}
    for name, result in results:
        assert Path(result.benchmark).name in scripts, name
        assert Path(result.benchmark).name.removesuffix(".py") in result.command or result.benchmark in result.command
        # A path that is not there would never change: the record would stay current whatever the code became.
        missing = [path for path in result.measures if not (ROOT / path).exists()]
        assert result.benchmark in result.measures and not missing, (name, missing)
    from bench.machine import MEASURES  # what the scripts that write their own records name
    assert all((ROOT / path).exists() for paths in MEASURES.values() for path in paths), MEASURES


def test_benchmark_result_refuses_unknown_fields_and_bad_dates():
    from pydantic import ValidationError

    good = {"benchmark": "bench/x.py", "what": "w", "command": "python bench/x.py", "date": "2026-01-02",
            "machine": "m", "load": "quiet", "result": "1x", "commit": "e21f442", "measures": ["bench/x.py"]}
    docs_reference.BenchmarkResult.model_validate(good)
    for bad in ({**good, "date": "yesterday"}, {**good, "speedup": 2}, {**good, "commit": "HEAD"},
                {**good, "measures": []}):
        with pytest.raises(ValidationError):
            docs_reference.BenchmarkResult.model_validate(bad)


HISTORY = re.compile(r"\b(first|second|third|fourth|fifth|sixth|earlier|later|previous|next|this|another) "
                     r"session\b|\bissue \d+|\(issue|this machine\b|where this was written", re.IGNORECASE)


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "bench" / "README.md",
                                  *sorted((ROOT / "docs").rglob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_read_as_a_manual(page: Path):
    found = [m.group(0) for m in HISTORY.finditer(page.read_text())]
    assert not found, f"{page.name}: {found} (the git log keeps history)"


def test_readme_is_the_first_five_minutes():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for must in ("make run", "make test", "fine_tuning.jobs.create", "chat.completions.create", "adapter"):
        assert must in text, must
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link


def test_table_cells_keep_pipes_and_angle_brackets_readable():
    assert docs_reference.cell("a | b\n  c") == "a \\| b c"
    assert docs_reference.cell("under <home>, `<home>/models`") == "under &lt;home>, `<home>/models`"
    assert docs_reference.cell("pattern `^(a|b)$`") == "pattern <code>^(a&#124;b)$</code>"
    assert docs_reference.cell("one ` backtick | here") == "one ` backtick \\| here"
