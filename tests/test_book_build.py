"""The static book's pieces that need no browser (tests/test_browser.py opens the built book):
MathJax served from a local file, the article and ledger pages generated from claims.toml, the
widget snapshots, the chapter selection of --execute, and the offline check of the built pages."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import ipywidgets
import nbformat
import pytest
import torch
from ipywidgets.embed import dependency_state

from minigen.course.book import article_page, claim_label, ledger_page, load_book
from minigen.course.ledger import Claim, load_claims
from minigen.checkpoints.model_config import ModelConfig
from minigen.course.widgets import LIVE_NOTE, quant_panel, snapshot_html

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("build_book", ROOT / "scripts" / "build_book.py")
build_book = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_book)


def test_mathjax_is_a_local_file_of_a_declared_package():
    """conf.py loads MathJax by a relative path (the book's _static/), and the package that copies
    it there ships that file: no CDN, and nothing copied by hand."""
    conf = build_book.conf_py(load_book())
    assert re.search(r"^mathjax_path = 'mathjax/[\w.-]+\.js'", conf, re.M), conf
    assert "http" not in conf.split("mathjax_path")[1].splitlines()[0]
    assert repr(build_book.MATHJAX_EXTENSION) in conf
    extension = importlib.import_module(build_book.MATHJAX_EXTENSION)
    static = Path(extension.__file__).parent / "static"
    assert (static / build_book.MATHJAX_PATH).is_file()
    assert (static / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").is_dir()  # the fonts travel too
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'"{build_book.MATHJAX_EXTENSION}' in pyproject  # a declared dependency, so CI installs it


class FakeApp:  # the extension's setup() sets mathjax_path itself: it must agree with conf.py
    def __init__(self):
        self.config = type("Config", (), {})()
        self.connected = []

    def connect(self, event, handler):
        self.connected.append(event)


def test_the_extension_points_at_the_same_file():
    app = FakeApp()
    importlib.import_module(build_book.MATHJAX_EXTENSION).setup(app)
    assert app.config.mathjax_path == build_book.MATHJAX_PATH
    assert "build-finished" in app.connected  # where it copies MathJax into the book


def test_article_page_lists_every_claim_and_links_it_to_the_ledger():
    claims = load_claims()
    page = article_page(build_book.ARTICLE.read_text(encoding="utf-8"), claims)
    ledger = ledger_page(load_book(), claims)
    assert "written in Chinese" in page and "## What it covers" in page
    for c in claims:
        assert f"{{ref}}`{c.id} <{claim_label(c)}>`" in page, c.id
        assert f"\n({claim_label(c)})=\n## {c.id}: " in ledger, c.id  # the target the link names
    assert page.count("{ref}`") == len(claims)
    ids = re.findall(r"^id = \"(\w+)\"", (ROOT / "minigen" / "course" / "claims.toml").read_text(encoding="utf-8"), re.M)
    assert ids == [c.id for c in claims] and len(ids) >= 7  # the TOML's own ids, read without the loader


def test_ledger_page_links_chapters_that_exist_and_escapes_markdown():
    book = load_book()
    chapter = book.chapters[4]
    odd = Claim(id="X1", claim="costs $5 | <b>*not* math</b> [x]", article_value="1 -> 2", measured="3",
                machine="counted", verdict="verified", chapter=chapter.number, source="a test")
    missing = Claim(id="X2", claim="c", article_value="a", measured="m", machine="2-core CPU",
                    verdict="refuted", chapter="99", source="s")
    page = ledger_page(book, [odd, missing])
    assert r"costs \$5 \| \<b\>\*not\* math\</b\> \[x\]" in page
    assert f"</{chapter.doc}>`" in page and chapter.doc.startswith("notebooks/")
    assert "| refuted | chapter 99 |" in page  # a chapter book.toml does not list: named, not linked
    assert "**1 verified** " not in page and "2 claims:** 1 verified, 1 refuted, 0 reframed" in page


def test_front_page_opens_with_the_article_and_ends_with_the_ledger():
    book = load_book()
    index = build_book.index_md(book)
    toctree = index.split("```{toctree}")[1].split("```")[0].strip().splitlines()[4:]
    assert toctree[0] == "The source article </article>" and toctree[-1] == "The claims ledger </ledger>"
    assert toctree[1:-1] == [f"{c.title} </{c.doc}>" for c in book.chapters]


def small_config() -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
                       hidden_dim=64, max_seq_len=512)


def test_snapshot_of_the_quant_panel_shows_its_default_state():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 64, 64, generator=g), torch.randn(2, 64, 64, generator=g)  # [Hkv, S, Dh]
    panel = quant_panel(keys, values, small_config(), context=256)
    shown = snapshot_html(dependency_state(panel), panel.model_id)
    assert LIVE_NOTE in shown
    assert panel.children[2].value in shown  # the numbers the live panel shows, as it shows them
    for name, value in (("bits", "4"), ("group size", "32"), ("fp window", "32")):
        assert re.search(rf">{name}</span> <input type=\"range\" disabled[^>]*> <b>{value}</b>", shown), name
    assert re.search(r"<b[^>]*>channel</b>", shown) and "token</span>" in shown  # the chosen button stands out


def test_snapshot_draws_output_images_and_plain_widgets():
    image = "iVBORw0KGgo="  # any base64 text: drawn inline as a data URI
    state = {"box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_out", "IPY_MODEL_bar"]}},
             "out": {"model_name": "OutputModel", "state": {"outputs": [
                 {"output_type": "display_data", "data": {"image/png": image, "text/plain": "<Figure>"}},
                 {"output_type": "stream", "name": "stdout", "text": "a < b\n"}]}},
             "bar": {"model_name": "FloatProgressModel", "state": {"value": 3, "max": 4, "description": "load"}}}
    shown = snapshot_html(state, "box")
    assert f'src="data:image/png;base64,{image}"' in shown and "<pre>a &lt; b\n</pre>" in shown
    assert '<progress value="3" max="4">' in shown
    assert LIVE_NOTE not in shown  # nothing to move: a finished progress bar gets no "live" note
    assert "not saved" in snapshot_html({}, "gone")


def test_snapshot_widgets_replaces_every_view_and_drops_the_state():
    slider = ipywidgets.IntSlider(value=3, min=1, max=9, description="window")
    view = {"model_id": slider.model_id, "version_major": 2, "version_minor": 0}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("slider", outputs=[nbformat.v4.new_output(
        "display_data", data={build_book.WIDGET_VIEW: view, "text/plain": "IntSlider(value=3)"})])]
    nb.metadata["widgets"] = {build_book.WIDGET_STATE: {"state": dependency_state(slider)}}
    assert build_book.snapshot_widgets(nb) == 1
    data = nb.cells[0].outputs[0]["data"]
    assert set(data) == {"text/html", "text/plain"} and "<b>3</b>" in data["text/html"]
    assert "widgets" not in nb.metadata  # with it, myst-nb would load the widgets' JavaScript from a CDN


def test_execute_chooses_chapters_by_number():
    book = load_book()
    assert build_book.chosen_chapters(book, "off") == set()
    assert build_book.chosen_chapters(book, "force") == {c.notebook for c in book.chapters}
    by_number = {c.number: c.notebook for c in book.chapters}
    assert build_book.chosen_chapters(book, "00, 04") == {by_number["00"], by_number["04"]}
    with pytest.raises(SystemExit, match="no chapter numbered 99"):
        build_book.chosen_chapters(book, "00,99")


def test_offline_check_finds_scripts_and_stylesheets_from_the_network(tmp_path):
    (tmp_path / "a.html").write_text('<script src="_static/mathjax/tex-chtml.js"></script>'
                                     '<a href="https://example.org/">a link is fine</a>'
                                     '<link rel="stylesheet" href="_static/x.css">')
    assert build_book.external_resources(tmp_path) == []
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.html").write_text('<script defer src="https://cdn.example/mathjax.js"></script>'
                                             "<link rel='stylesheet' href='//fonts.example/f.css'>")
    assert build_book.external_resources(tmp_path) == [("sub/b.html", "https://cdn.example/mathjax.js"),
                                                       ("sub/b.html", "//fonts.example/f.css")]


def test_executed_panels_become_snapshots_and_cache_reuses_outputs(tmp_path, capsys):
    """A real kernel runs a one-cell chapter with a slider: the saved widget state becomes the
    snapshot; a second build with --execute cache reuses the outputs without a kernel."""
    (tmp_path / "notebooks").mkdir()
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("import ipywidgets as w\nw.IntSlider(value=7, min=1, max=9, description='window')")]
    nbformat.write(nb, tmp_path / "notebooks" / "00_x.ipynb")
    (tmp_path / "book.toml").write_text('[book]\ntitle = "t"\nauthors = ["a"]\ndescription = "d"\n\n[[chapter]]\n'
                                        'notebook = "notebooks/00_x.ipynb"\ntitle = "x"\nlearn = ["y"]\nminutes = 1\ngpu = false\n')
    book = load_book(tmp_path / "book.toml")
    for run in range(2):
        src = tmp_path / f"src{run}"
        build_book.copy_sources(book, src)
        build_book.execute_chapters(book, src, "cache", 120, tmp_path / "executed")
        shown = nbformat.read(src / "notebooks" / "00_x.ipynb", as_version=4).cells[0].outputs[0]["data"]["text/html"]
        assert LIVE_NOTE in shown and "<b>7</b>" in shown and ">window</span>" in shown
    log = capsys.readouterr().out
    assert log.count("executed in") == 1 and "reused from the last build" in log
