"""`report --html`: one self-contained page of a plan file, read back with an HTML parser and, where
Chromium is installed, loaded by a real browser engine."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from mpipe_tune.cli import main
from mpipe_tune.plan_file import all_plan_names, load_plan


class Page(HTMLParser):
    """The parts of the page a reader relies on: images, table rows, links out, scripts, notes."""

    def __init__(self):
        super().__init__()
        self.images: list[dict] = []
        self.rows: list[str] = []
        self.external: list[str] = []
        self.scripts = 0
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.images.append(a)
        if tag == "tr" and "data-plan" in a:
            self.rows.append(a["data-plan"])
        if tag == "script":
            self.scripts += 1
        for key in ("src", "href"):
            if key in a and not a[key].startswith("data:"):
                self.external.append(a[key])

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("report")
    assert main(["plan", "--trials", "12", "--no-progress", "--storage", f"sqlite:///{folder / 'study.db'}",
                 "--out", str(folder / "plan.json"), "--current", "pp=4,tp=1,dp=1,schedule=1f1b,M=8",
                 "--pp", "2,4"]) == 0  # pipelines: at pp 1 the bounds settle the space with no trial to draw
    return folder


def read_page(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def test_the_page_holds_every_stored_plan_and_its_pictures_inline(planned, capsys):
    out = planned / "report.html"
    assert main(["report", str(planned / "plan.json"), "--html", str(out)]) == 0
    capsys.readouterr()
    page = read_page(out)
    names = all_plan_names(load_plan(planned / "plan.json"))
    assert "current" in names and "megatron@own" in names
    assert sorted(page.rows) == sorted(names)  # the comparison table: a row per stored plan
    assert [i["alt"].split(" of ")[0] for i in page.images] == ["timelines", "peak memory per rank",
                                                                 "trials: step time against peak memory"]
    assert page.images[0]["alt"] == "timelines of " + ", ".join(names)  # every stored plan drawn
    for image in page.images:
        assert image["src"].startswith("data:image/png;base64,")
        assert base64.b64decode(image["src"].split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert page.external == [] and page.scripts == 0  # opens offline: nothing fetched, nothing run
    trials = json.loads((planned / "plan.json").read_text())["search"]["trials"]  # the bound search may stop early
    assert 0 < trials <= 12 and any(f"{trials} trials" in t for t in page.text)


def test_without_the_study_the_page_says_so_and_keeps_the_rest(planned, capsys):
    out = planned / "no-study.html"
    assert main(["report", str(planned / "plan.json"), "--html", str(out),
                 "--storage", f"sqlite:///{planned / 'elsewhere.db'}"]) == 0
    capsys.readouterr()
    page = read_page(out)
    assert len(page.images) == 2
    assert any("trials are not shown" in t and "elsewhere.db" in t for t in page.text)


@pytest.mark.parametrize("args,words", [
    (["missing.json", "--html", "r.html"], "cannot read plan file"),
    (["PLAN", "--html", "r.txt"], "must end in .html"),
])
def test_bad_input_is_one_line_and_writes_nothing(planned, tmp_path, capsys, args, words):
    args = [a.replace("PLAN", str(planned / "plan.json")) if a == "PLAN" else a for a in args]
    args = [str(tmp_path / a) if a.startswith(("r.", "missing")) else a for a in args]
    assert main(["report", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Chromium is not installed (apt-get install chromium)")
def test_a_headless_browser_loads_the_page_and_decodes_every_picture(planned, capsys):
    out = planned / "browser.html"
    assert main(["report", str(planned / "plan.json"), "--html", str(out)]) == 0
    capsys.readouterr()
    # A copy with a probe script: after the load event, count the pictures the engine decoded and the
    # table's rows, and note any script error; the page itself has no script.
    probe = """<script>window.onerror = function (m) { document.title = "error " + m; };
window.addEventListener("load", function () {
  var images = Array.from(document.images), out = document.createElement("pre");
  out.id = "probe";
  out.textContent = images.length + " " + images.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length
    + " " + document.querySelectorAll("#comparison-table tr[data-plan]").length;
  document.body.appendChild(out);
});</script>"""
    probed = planned / "probed.html"
    probed.write_text(out.read_text(encoding="utf-8").replace("</body>", probe + "</body>"), encoding="utf-8")
    result = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                             "--dump-dom", probed.as_uri()], capture_output=True, text=True,
                            timeout=600)  # a hang guard (the page runs on virtual time)
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    assert "<title>error" not in dom
    counts = dom.split('<pre id="probe">', 1)[1].split("<", 1)[0].split()
    rows = len(read_page(out).rows)
    assert counts == ["3", "3", str(rows)]
