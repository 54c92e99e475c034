"""The HTML page parsed and checked: self-contained, and its sections true to the report."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Any

from llmp.analysis import analyze
from llmp.analysis.causes import WORDS as CAUSE_WORDS
from llmp.analysis.changes import MAX_CHANGES
from llmp.analysis.html import is_break
from llmp.analysis.render import sentence


def collect_changes(
    paths: list[str], rep: dict[str, Any] | None = None, *, limit: int = MAX_CHANGES
) -> list[dict[str, Any]]:
    """The diffs `llmp analyze --html` collects in its pass over the recording."""
    result = analyze(paths, rows=False, changes=limit)
    try:
        return result.change_list()
    finally:
        result.close()


class Element:
    def __init__(self, tag: str, attrs: dict[str, str], parent: Element | None) -> None:
        self.tag = tag
        self.attrs = attrs
        self.parent = parent
        self.children: list[Element] = []
        self.text: list[str] = []

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def all_text(self) -> str:
        return "".join(self.text) + "".join(c.all_text() for c in self.children)

    def walk(self) -> list[Element]:
        out = [self]
        for c in self.children:
            out += c.walk()
        return out

    def find(self, tag: str | None = None, cls: str | None = None) -> list[Element]:
        return [
            e
            for e in self.walk()[1:]
            if (tag is None or e.tag == tag) and (cls is None or cls in e.classes)
        ]


VOID = {"meta", "link", "br", "img", "input", "hr", "source", "col", "area", "base", "wbr"}


class Tree(HTMLParser):
    """A small DOM: every element with its attributes, children and text."""

    def __init__(self, source: str) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {}, None)
        self.cur = self.root
        self.tags: list[str] = []
        self.decl: list[str] = []
        self.feed(source)
        self.close()

    def handle_decl(self, decl: str) -> None:
        self.decl.append(decl)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = Element(tag, {k: v or "" for k, v in attrs}, self.cur)
        self.cur.children.append(el)
        self.tags.append(tag)
        if tag not in VOID:
            self.cur = el

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = Element(tag, {k: v or "" for k, v in attrs}, self.cur)
        self.cur.children.append(el)
        self.tags.append(tag)

    def handle_endtag(self, tag: str) -> None:
        node: Element | None = self.cur
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.cur = node.parent

    def handle_data(self, data: str) -> None:
        self.cur.text.append(data)


def turns(rep: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in rep["rows"] if r["kind"] == "turn"]


def main_cause(row: dict[str, Any]) -> str | None:
    losses = [x for x in (row["lost_client"], row["lost_external"]) if x]
    return max(losses, key=lambda x: x["tokens"])["cause"] if losses else None


def check_self_contained(tree: Tree, source: str) -> None:
    """Nothing the page could fetch: no script, link, img, iframe, url(), no http(s) address."""
    assert not {"script", "link", "img", "iframe", "object", "embed"} & set(tree.tags)
    for el in tree.root.walk():
        for name, value in el.attrs.items():
            assert name != "src"
            if name in ("href", "xlink:href"):
                assert value.startswith("#"), value
            assert not re.match(r"\s*(https?:)?//", value), (name, value)
    style = "".join(e.all_text() for e in tree.root.find("style"))
    assert "url(" not in style and "@import" not in style and "@font-face" not in style
    csp = [
        m for m in tree.root.find("meta") if m.attrs.get("http-equiv") == "Content-Security-Policy"
    ]
    assert csp and "default-src 'none'" in csp[0].attrs["content"]
    assert "http://" not in source and "https://" not in source


def check_structure(tree: Tree, rep: dict[str, Any], changes: list[dict[str, Any]]) -> None:
    """The charts have their elements: bars, markers, legend, findings, diffs."""
    # Timeline: one bar group per turn, in each conversation's chart.
    bars = tree.root.find("g", "turn")
    assert len(bars) == len(turns(rep))
    by_conv: dict[str, list[Element]] = {}
    for g in bars:
        by_conv.setdefault(g.attrs["data-conversation"], []).append(g)
    for conv in {r["conversation"] for r in turns(rep)}:
        mine = sorted((r for r in turns(rep) if r["conversation"] == conv), key=lambda r: r["turn"])
        drawn = by_conv[str(conv)]
        assert [int(g.attrs["data-row"]) for g in drawn] == [r["id"] for r in mine]
        assert [int(g.attrs["data-turn"]) for g in drawn] == [r["turn"] for r in mine]
        chart = drawn[0].parent
        assert chart is not None and chart.tag == "svg" and "timeline" in chart.classes
        for g in drawn:
            assert g.find("title"), "every bar has a hover title"
            assert g.find("rect"), "every bar is drawn"
    # A loss marker per turn with a loss, coloured by its cause.
    markers = tree.root.find("path", "loss-marker")
    lossy = [r for r in turns(rep) if main_cause(r)]
    assert len(markers) == len(lossy)
    for g in bars:
        row = next(r for r in turns(rep) if r["id"] == int(g.attrs["data-row"]))
        cause = main_cause(row)
        if cause is None:
            assert "data-cause" not in g.attrs and not g.find("path", "loss-marker")
        else:
            assert g.attrs["data-cause"] == cause
            assert f"f-{cause}" in g.find("path", "loss-marker")[0].classes
    # A legend entry per cause, in the words of the readable report.
    legend = {
        li.attrs["data-cause"]: li.all_text()
        for li in tree.root.find("li", "legend-item")
        if "data-cause" in li.attrs
    }
    assert set(legend) == set(rep["time"]["by_cause"])
    for cause, words in legend.items():
        assert CAUSE_WORDS[cause] in words
    # Loss by cause: one bar per cause.
    cause_bars = tree.root.find("g", "cause-bar")
    assert sorted(g.attrs["data-cause"] for g in cause_bars) == sorted(rep["time"]["by_cause"])
    # Findings with their fixes, worded as the readable report words them.
    items = tree.root.find("li", "finding")
    assert len(items) == len(rep["findings"])
    for li, f in zip(items, rep["findings"], strict=True):
        what, fix = sentence(f)
        assert what in li.all_text() and fix in li.all_text()
        assert li.attrs["data-kind"] == f["kind"]
    # Per client, its tools offered and called.
    clients = tree.root.find("div", "client")
    assert [d.attrs["data-client"] for d in clients] == [c["client"] for c in rep["clients"]]
    tool_rows = tree.root.find("tr", "tool")
    assert len(tool_rows) == len(rep["tools"])
    # What changed: a diff block per break.
    blocks = tree.root.find("section", "change")
    assert len(blocks) == len(changes) == sum(1 for r in rep["rows"] if is_break(r))
    assert [(int(b.attrs["data-session"]), int(b.attrs["data-row"])) for b in blocks] == [
        (c["session"], c["id"]) for c in changes
    ]
    ids = [e.attrs["id"] for e in tree.root.walk() if "id" in e.attrs]
    assert len(ids) == len(set(ids)), "ids are unique"
    for a in tree.root.find("a"):
        assert a.attrs["href"][1:] in ids, "every link has its target"
