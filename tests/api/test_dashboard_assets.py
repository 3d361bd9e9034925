"""The dashboard is served by the API from package data, loads nothing from elsewhere, and its imports resolve."""

from __future__ import annotations

import re

from app.routes.dashboard import DASHBOARD_DIR


def test_page_and_assets_are_served_without_a_key(client):
    client.headers.pop("Authorization")
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for asset in re.findall(r'(?:src|href)="(/ui/[^"]+)"', page.text):
        response = client.get(asset)
        assert response.status_code == 200 and response.content, asset
    assert client.get("/ui/vendor/uPlot.LICENSE").text.startswith("The MIT License")
    assert client.get("/ui/../core/settings.py").status_code == 404
    assert client.get("/jobs").status_code == 401  # the API itself still needs the key


def test_no_asset_is_fetched_from_another_origin_and_every_module_import_exists():
    for path in [DASHBOARD_DIR / "index.html", DASHBOARD_DIR / "style.css", *DASHBOARD_DIR.glob("js/*.js")]:
        text = path.read_text()
        assert not re.search(r"(src|href|import)[^\n]*https?://", text), path
        for module in re.findall(r'from "\./([\w.]+)"', text):
            assert (DASHBOARD_DIR / "js" / module).is_file(), (path, module)


def test_every_dashboard_file_is_package_data():
    import fnmatch
    import tomllib

    from tests.conftest import ROOT

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["app"]
    files = [p.relative_to(DASHBOARD_DIR.parent).as_posix() for p in DASHBOARD_DIR.rglob("*") if p.is_file()]
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in patterns)]
    assert files and not missing, f"not shipped in the wheel: {missing}"


def test_no_inline_script_event_handler_or_markup_from_strings():
    """A Content-Security-Policy without 'unsafe-inline' (or 'unsafe-eval') runs the whole dashboard."""
    from html.parser import HTMLParser

    found: list[tuple[str, dict[str, str | None]]] = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            found.append((tag, dict(attrs)))

    Tags().feed((DASHBOARD_DIR / "index.html").read_text())
    scripts = [attrs for tag, attrs in found if tag == "script"]
    assert scripts and all((attrs.get("src") or "").startswith("/ui/") for attrs in scripts)
    assert not [(tag, name) for tag, attrs in found for name in attrs if name.startswith("on") or name == "style"]
    for path in DASHBOARD_DIR.glob("js/*.js"):
        text = path.read_text()
        # Elements come from h() (text nodes, listeners, CSSOM styles): never parsed from strings.
        for pattern in (r"innerHTML", r"outerHTML", r"insertAdjacentHTML", r"\beval\(", r"new Function",
                        r"setAttribute\(\s*[\"'](on|style)", r"javascript:", r"document\.write"):
            assert not re.search(pattern, text), (path.name, pattern)
