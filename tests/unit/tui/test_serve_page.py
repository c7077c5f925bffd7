"""`eyas tui --serve`'s page loads nothing from another host (tui/serve.py: local_only)."""

from __future__ import annotations

from pathlib import Path

import textual_serve

from eyas.tui.serve import local_only


def test_the_served_template_keeps_its_own_files_and_drops_the_google_fonts_link():
    template = (Path(textual_serve.__file__).parent / "templates" / "app_index.html").read_text()
    page = local_only(template)
    assert "fonts.googleapis.com" in template and "fonts.googleapis.com" not in page
    # Only the one tag goes: the page's own stylesheet and script stay, and so does the rest.
    assert page.count("{{ config.static.url }}") == template.count("{{ config.static.url }}")
    assert len(template) - len(page) < 200


def test_absolute_links_and_scripts_go_and_relative_ones_stay():
    html = (
        '<link rel="stylesheet" href="//cdn.example/x.css">'
        '<script src="http://cdn.example/a.js"></script>'
        '<link rel="stylesheet" href="/tok/static/css/xterm.css" />'
        '<script src="/tok/static/js/textual.js"></script>'
        '<a href="https://textual.textualize.io">docs</a>'
    )
    assert local_only(html) == (
        '<link rel="stylesheet" href="/tok/static/css/xterm.css" />'
        '<script src="/tok/static/js/textual.js"></script>'
        '<a href="https://textual.textualize.io">docs</a>'
    )
