"""The stage pipeline as one line: `✓ prepare → ▶ extract #2 → · vocab → · train`."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from eyas.state import display

from .. import format as fmt


def pipeline_text(stages: list[dict], selected: str | None = None, compact: bool = False) -> Text:
    out = Text()
    for i, s in enumerate(stages):
        if i:
            out.append(" → ", style="dim")
        glyph, style = fmt.STATE_STYLE.get(s["state"], ("•", ""))
        name = s["name"]
        label = f"{glyph} {name}"
        if s["attempts"] and s["attempts"] > 1:
            label += f" #{s['attempts']}"
        if not compact and s.get("duration") is not None and s["state"] != "pending":
            label += f" {display.duration(s['duration'])}"
        out.append(label, style=style + (" underline" if name == selected else ""))
    return out


class Pipeline(Static):
    DEFAULT_CSS = """
    Pipeline { height: auto; padding: 0 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.stages: list[dict] = []
        self.selected: str | None = None

    def show(self, stages: list[dict], selected: str | None) -> None:
        self.stages, self.selected = stages, selected
        self._draw()

    def on_resize(self) -> None:
        self._draw()

    def _draw(self) -> None:
        text = pipeline_text(self.stages, self.selected)
        if self.size.width and text.cell_len > self.size.width - 2:
            text = pipeline_text(self.stages, self.selected, compact=True)
        self.update(text)
