"""The results index (results/README.md): its links resolve from where it lies, its headings nest one level at a
time and name each section once, every folder README under results/ is reachable from it, and its generated
sections are exactly what the generators write from the committed result files (no figure typed by hand)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from fasttrain.files import write_into

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "results" / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MARKERS = ("bench-results", "record-results", "many-results", "lab-results", "tune-results", "speedrun-results",
           "memory-heldout")


def links(text: str) -> list[str]:
    return [m.group(1) for m in LINK.finditer(text) if not re.match(r"[a-z]+:", m.group(1))]


def heading_slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def headings(text: str) -> list[tuple[int, str]]:
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#{1,6}) (.*)", line)):
            out.append((len(m.group(1)), m.group(2).strip()))
    return out


def unresolved_links(path: Path) -> list[str]:
    """Every relative link of the Markdown file ``path`` that does not lead to a file, a folder or a heading."""
    text = path.read_text()
    slugs = {heading_slug(h) for _, h in headings(text)}
    bad = []
    for target in links(text):
        where, _, anchor = target.partition("#")
        if not where:
            if anchor not in slugs:
                bad.append(target)
        elif not (path.parent / where).exists():
            bad.append(target)
    return bad


def test_unresolved_links_finds_a_broken_link_and_a_wrong_anchor(tmp_path):
    page = tmp_path / "README.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text("# Top\n\n## A section\n\n[ok](there.md) [ok](#a-section) [gone](nothere.md) [no](#nowhere) "
                    "[web](https://example.org)\n")
    assert unresolved_links(page) == ["nothere.md", "#nowhere"]


def test_every_link_of_the_index_resolves_from_results():
    assert unresolved_links(INDEX) == []


def test_the_index_nests_its_headings_and_names_each_once():
    levels = headings(INDEX.read_text())
    assert [lvl for lvl, _ in levels].count(1) == 1 and levels[0][0] == 1
    for (before, _), (after, title) in zip(levels, levels[1:]):
        assert after <= before + 1, f"heading {title!r} skips a level"
    # each heading once under its parents (a model's name may recur under another machine)
    path, seen = [], set()
    for lvl, title in levels:
        path = path[:lvl - 1] + [title]
        assert tuple(path) not in seen, f"heading {' > '.join(path)!r} twice"
        seen.add(tuple(path))


def test_every_readme_under_results_is_reachable_from_the_index():
    text = INDEX.read_text()
    targets = {(INDEX.parent / t.partition("#")[0]).resolve() for t in links(text) if t.partition("#")[0]}
    for readme in sorted((ROOT / "results").rglob("README.md")):
        if readme == INDEX:
            continue
        assert readme.resolve() in targets or readme.parent.resolve() in targets, \
            f"{readme.relative_to(ROOT)} is not linked from results/README.md"


def _dev_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_tune():
    return _dev_module("bench_tune", "dev/tune/bench_tune.py")


def test_the_index_sections_are_what_the_generators_write(tmp_path, monkeypatch):
    """Each generated section written again from the committed files, into a copy of the index: nothing changes."""
    from fasttrain.bench.readme import link_base_from, readme_section
    from fasttrain.lab.experiments import speedrun_report

    text = INDEX.read_text()
    for name in MARKERS:
        assert text.count(f"<!-- {name}:start -->") == 1 and text.count(f"<!-- {name}:end -->") == 1
    monkeypatch.chdir(ROOT)         # the generators name folders from the repository root, as the index's commands do
    copy = tmp_path / "results" / "README.md"
    copy.parent.mkdir()
    copy.write_text(text)
    # the copy lies elsewhere: its links are written as from results/, where the index lies
    index = Path("results/README.md")
    for marker, folder in (("bench-results", "results/nvidia-h200"), ("record-results", "results/record/nvidia-h200"),
                           ("many-results", "results/many/nvidia-h200"), ("lab-results", "results/lab/nvidia-h200")):
        section = readme_section(folder, link_base_from(folder, index),
                                 protocol="full" if marker == "bench-results" else "link")
        write_into(copy, section, start=f"<!-- {marker}:start -->", end=f"<!-- {marker}:end -->")
    tune = _bench_tune()
    section = "\n".join(tune.readme(Path(f), index) for f in
                        ("results/tune/nvidia-h100-80gb-hbm3", "results/tune/nvidia-h200"))
    write_into(copy, section, start=tune.README_START, end=tune.README_END)
    section = speedrun_report.readme_section("results/speedrun/nvidia-h100", ("results/speedrun/nvidia-h100-variants",),
                                             index)
    write_into(copy, section, start=speedrun_report.README_START, end=speedrun_report.README_END)
    # the estimator out of sample: from the committed table (tests/test_memory_heldout.py holds the table itself)
    heldout = _dev_module("heldout", "dev/memory/heldout.py")
    data = json.loads((ROOT / "results" / "memory" / "heldout.json").read_text())
    write_into(copy, heldout.readme_section(data), start=heldout.START, end=heldout.END)
    assert copy.read_text() == text, "results/README.md differs from its generators' output: run the commands it names"


def test_the_readme_holds_no_generated_results_and_links_the_index():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 350
    assert "<!--" not in readme.replace("<!-- integrator:", "")    # placeholders for the integrator only
    assert "(results/README.md)" in readme
    assert unresolved_links(ROOT / "README.md") == []
