"""`llmp analyze --tokenize URL` and `llmp analyze --html FILE`."""

from __future__ import annotations

import io
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmp.analysis.render import sentence
from llmp.cli import main
from llmp.demo.fakes import Upstream
from tests.support import overflow_scenarios as osc
from tests.support import scenarios as sc
from tests.support.html_checks import Tree, check_self_contained, check_structure, collect_changes


@pytest.fixture(scope="module")
def llama() -> Iterator[Upstream]:
    """The bundled fake llama-server: its /tokenize counts one token per 4 characters."""
    with Upstream("llama") as up:
        yield up


def record(tmp_path: Path, traffic: sc.Traffic, name: str, mode: str = "full") -> Path:
    return traffic.write(tmp_path / f"{name}.jsonl", mode)


def report(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    out: dict[str, Any] = orjson.loads(capsys.readouterr().out)
    return out


# -- --tokenize -------------------------------------------------------------------


def test_tokenize_then_analyse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Upstream
) -> None:
    path = record(tmp_path, sc.changed_system(), "rec")
    assert main(["analyze", str(path), "--json"]) == 0
    before = report(capsys)
    assert main(["analyze", str(path), "--json", "--tokenize", llama.url]) == 0
    cap = capsys.readouterr()
    err = cap.err.splitlines()
    assert len(err) == 1 and err[0].startswith("llmp analyze: tokenized ")
    assert f"enriched 5 records in {path}" in err[0]
    rep = orjson.loads(cap.out)
    # Every record now carries the server's counts...
    for line in path.read_bytes().splitlines():
        assert orjson.loads(line)["tokens"]["messages"]
    # ...and the analysis uses them: the composition carries the source.
    for row in rep["rows"]:
        assert {v["source"] for v in row["composition"].values()} == {"tokenizer"}
    # A loss taken from the server's counters is the server's, with or without them.
    broken = next(r for r in rep["rows"] if r["lost_client"])
    assert broken["lost_client"]["ms"]["source"] == "server"
    assert rep["time"]["lost_ms"]["source"] == "server"
    old = next(r for r in before["rows"] if r["lost_client"])
    assert old["lost_client"]["ms"]["source"] == "server"
    # The verdict is the same; only the strength of the numbers changed.
    assert [f["kind"] for f in rep["findings"]] == [f["kind"] for f in before["findings"]]


def test_tokenize_several_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Upstream
) -> None:
    a = record(tmp_path, sc.clean_chat(), "a")
    later = sc.Traffic(t=sc.T0 + 86_400_000)
    sc.work(sc.Agent(later, sc.LlamaServer()), 2)
    b = record(tmp_path, later, "b")
    assert main(["analyze", str(a), str(b), str(a), "--tokenize", llama.url, "--json"]) == 0
    cap = capsys.readouterr()
    assert cap.err.count("llmp analyze: tokenized ") == 2  # each file once
    rep = orjson.loads(cap.out)
    assert {v["source"] for r in rep["rows"] for v in r["composition"].values()} == {"tokenizer"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("server", ["ollama", "down"])
def test_tokenize_failure_leaves_the_file_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], server: str
) -> None:
    path = record(tmp_path, sc.clean_chat(), "rec")
    original = path.read_bytes()
    if server == "ollama":
        with Upstream("ollama") as up:
            code = main(["analyze", str(path), "--tokenize", up.url])
    else:
        code = main(["analyze", str(path), "--tokenize", f"http://127.0.0.1:{free_port()}"])
    assert code == 2
    cap = capsys.readouterr()
    assert cap.out == ""  # nothing analysed
    assert cap.err.startswith("llmp analyze: ") and cap.err.count("\n") == 1
    assert path.read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.jsonl"]


def test_tokenize_digest_recording(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Upstream
) -> None:
    path = record(tmp_path, sc.clean_chat(), "rec", "digest")
    original = path.read_bytes()
    assert main(["analyze", str(path), "--tokenize", llama.url]) == 2
    assert "nothing to count" in capsys.readouterr().err
    assert path.read_bytes() == original


def test_tokenize_refuses_stdin(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, llama: Upstream
) -> None:
    data = b"".join(sc.clean_chat().lines("full"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["analyze", "-", "--tokenize", llama.url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmp analyze: --tokenize rewrites the recording in place")
    assert "standard input" in err


# -- --html ---------------------------------------------------------------------------


def check_page(out: Path, rep: dict[str, Any], changes: bool) -> str:
    source = out.read_text(encoding="utf-8")
    tree = Tree(source)
    check_self_contained(tree, source)
    blocks = tree.root.find("section", "change")
    if changes:
        assert blocks, "the what-changed diffs were collected"
    else:
        assert blocks == [] and "the diffs were not collected" in source
    return source


def test_html_with_the_readable_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record(tmp_path, sc.changed_system(), "rec", "digest")
    out = tmp_path / "report.html"
    assert main(["analyze", str(path), "--html", str(out)]) == 0
    cap = capsys.readouterr()
    assert "Findings" in cap.out and "changed its system prompt" in cap.out
    assert cap.err == f"llmp analyze: wrote {out}\n"
    assert main(["analyze", str(path), "--json"]) == 0
    rep = report(capsys)
    source = check_page(out, rep, changes=True)
    tree = Tree(source)
    check_structure(tree, rep, collect_changes([str(path)], rep))


def test_html_with_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record(tmp_path, sc.title_side_call(), "rec")
    out = tmp_path / "report.html"
    assert main(["analyze", str(path), "--json", "--html", str(out)]) == 0
    rep = report(capsys)
    assert rep["v"] == 1 and rep["rows"]
    source = check_page(out, rep, changes=True)
    for f in rep["findings"]:
        assert sentence(f)[0].split(":")[0] in source.replace("&#x27;", "'")


def test_html_from_stdin_has_its_diffs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b"".join(sc.changed_system().lines("digest"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    out = tmp_path / "stdin.html"
    assert main(["analyze", "-", "--json", "--html", str(out)]) == 0
    check_page(out, report(capsys), changes=True)  # one pass: standard input is enough


def test_html_with_tokenize_and_a_gate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Upstream
) -> None:
    """Everything at once: enrich, print, draw, and fail the gate."""
    path = record(tmp_path, osc.ollama_truncating(), "rec")
    out = tmp_path / "all.html"
    args = ["analyze", str(path), "--tokenize", llama.url, "--html", str(out)]
    assert main([*args, "--fail-on", "context_overflow"]) == 1
    cap = capsys.readouterr()
    err = cap.err.splitlines()
    assert err[0].startswith("llmp analyze: tokenized ")
    assert err[1] == f"llmp analyze: wrote {out}"
    assert err[2].startswith("llmp: FAIL context_overflow qwen3:8b: ")
    source = out.read_text(encoding="utf-8")
    assert 'data-kind="context_overflow"' in source
    assert "silently dropped the start of" in source
    assert main(["analyze", str(path), "--json"]) == 0
    rep = report(capsys)
    check_structure(Tree(source), rep, collect_changes([str(path)], rep))


@pytest.mark.parametrize("where", ["missing/dir/out.html", "."])
def test_html_bad_destination(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    path = record(tmp_path, sc.clean_chat(), "rec")
    assert main(["analyze", str(path), "--html", str(tmp_path / where)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.startswith("llmp analyze: --html ")
