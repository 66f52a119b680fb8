"""The KG contract, the Wikispeedia and MediaWiki loaders, and the committed sample."""

from __future__ import annotations

import bz2
import io
import re
from collections import deque
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from osvl.errors import DataError
from osvl.kg import mediawiki, wikispeedia
from osvl.kg.schema import SAMPLE_DIR, fold, load_kg, write_kg

MW_SAMPLE = "mediawiki/enwiki-pages-articles-sample.xml.bz2"


@pytest.fixture(scope="module")
def kg():
    return load_kg()


# ---------------------------------------------------------------- schema


def _entity(i: int, **kw) -> dict:
    return {"id": i, "title": f"E{i}", "origin": "wikispeedia", **kw}


def test_write_load_roundtrip_degrees_and_eligibility(tmp_path: Path) -> None:
    ents = [_entity(i) for i in range(300)]  # 1% of 300 = 3 holders allowed
    for i in range(4):
        ents[i]["attributes"] = [{"key": "Kingdom", "value": "Animalia", "source": "Kingdom: Animalia"}]
    ents[10]["attributes"] = [
        {"key": "Capital", "value": "Addis Ababa", "source": "Capital Addis Ababa"},
        {"key": "Motto", "value": "one two three four five six seven", "source": "Motto: ..."},
    ]
    ents[11]["kind"] = "list"
    ents[11]["attributes"] = [{"key": "Capital", "value": "Rome", "source": "Capital Rome"}]
    ents[12]["aliases"] = ["Éthiopie"]
    counts = write_kg(tmp_path, ents, [(10, 11, "Capital"), (10, 11, "Capital"), (12, 10, "linked_to"), (5, 5, "x")])
    assert counts["links"] == 2  # duplicate and self-loop dropped
    g = load_kg(tmp_path)
    assert len(g) == 300
    assert g.entities[10]["out_degree"] == 1 and g.entities[10]["in_degree"] == 1
    assert g.neighbors(10) == [(11, "Capital")] and g.in_links[10] == [(12, "linked_to")]
    elig = {a["value"]: a["eligible"] for a in g.entities[10]["attributes"]}
    assert elig == {"Addis Ababa": True, "one two three four five six seven": False}
    assert not g.entities[0]["attributes"][0]["eligible"]  # shared by 4 > 1% of 300
    assert not g.entities[11]["attributes"][0]["eligible"]  # list pages give no answers
    assert g.find("ethiopie") == [12] and g.find("e10") == [10] and g.find("nothing") == []


def test_bad_tables_raise_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="unknown entity"):
        write_kg(tmp_path, [_entity(1)], [(1, 2, "linked_to")])
    with pytest.raises(DataError, match="not unique"):
        write_kg(tmp_path, [_entity(1), _entity(1)], [])
    with pytest.raises(DataError, match="kind"):
        write_kg(tmp_path, [_entity(1, kind="stub")], [])
    with pytest.raises(DataError, match="does not exist"):
        load_kg(tmp_path / "nowhere")
    write_kg(tmp_path, [_entity(1)], [])
    pq.write_table(pq.read_table(tmp_path / "links.parquet").drop_columns(["relation"]), tmp_path / "links.parquet")
    with pytest.raises(DataError, match="missing columns"):
        load_kg(tmp_path)


def test_fold() -> None:
    assert fold("Chichén Itzá") == fold("chichen_itza") == fold("Chichen-Itza") == "chichen itza"


# ---------------------------------------------------------------- Wikispeedia infobox parsing


def _article(shared_data: Path, name: str) -> str:
    import tarfile

    with tarfile.open(shared_data / "wikispeedia" / "plaintext_articles.tgz") as tar:
        return tar.extractfile(f"plaintext_articles/{name}.txt").read().decode("utf-8")


def test_infobox_lines_of_real_articles(shared_data: Path, kg) -> None:
    box, prose = wikispeedia.split_article(_article(shared_data, "Ethiopia"))
    assert prose.startswith("Ethiopia ( Ge'ez")
    attrs = wikispeedia.parse_infobox(box, {"Official languages", "Capital", "Currency"}, "Ethiopia")
    got = {a["key"]: a for a in attrs}
    assert got["Official languages"]["value"] == "Amharic"
    assert got["Official languages"]["source"] == "Official languages Amharic"
    assert got["Capital (and largest city)"]["value"] == "Addis Ababa"
    assert got["Capital (and largest city)"]["source"] == "Capital / (and largest city) Addis Ababa"
    assert got["Motto"]["value"] == "none"  # a Key: value line
    # the committed sample used the learned key vocabulary on the same lines
    eth = kg.entities[kg.find("Ethiopia")[0]]
    sample = {(a["key"], a["value"]): a for a in eth["attributes"]}
    assert ("Official languages", "Amharic") in sample and ("Capital (and largest city)", "Addis Ababa") in sample
    lion = kg.entities[kg.find("Lion")[0]]
    lion_attrs = {a["key"]: a for a in lion["attributes"]}
    assert lion_attrs["Kingdom"]["value"] == "Animalia" and not lion_attrs["Kingdom"]["eligible"]
    assert lion_attrs["Binomial name"]["value"] == "Panthera leo" and lion_attrs["Binomial name"]["eligible"]
    einstein = kg.entities[kg.find("Albert Einstein")[0]]
    born = [a["value"] for a in einstein["attributes"] if a["key"] == "Born"]
    assert born[:2] == ["March 14, 1879", "Ulm, Württemberg, Germany"]


def test_lead_aliases() -> None:
    assert wikispeedia.lead_aliases("Giant panda", "The giant panda, also known as the panda bear or simply panda, "
                                    "is a bear species endemic to China.") == ["panda bear", "panda"]
    assert wikispeedia.lead_aliases("Colosseum", "The Colosseum or Coliseum is an amphitheatre.") == ["Coliseum"]


# ---------------------------------------------------------------- MediaWiki XML


def test_mediawiki_redirects_infoboxes_links(shared_data: Path) -> None:
    raw = bz2.decompress((shared_data / MW_SAMPLE).read_bytes()).decode("utf-8")
    # one extra page linking by redirect titles that the real export defines
    extra = ("<page><title>Osvl probe</title><ns>0</ns><id>1</id><revision><text>"
             "See [[Afro-asiatic languages|Afro-Asiatic]], [[AbacuS]] and [[Talk:Abacus]].</text></revision></page>")
    xml = raw.replace("</mediawiki>", extra + "</mediawiki>")
    ents, links = mediawiki.load(io.BytesIO(xml.encode("utf-8")))
    by = {e["title"]: e for e in ents}
    assert len(ents) == 107 and all(e["origin"] == "mediawiki" for e in ents)
    # namespace-0 redirects became aliases of their targets
    assert {"AfroAsiaticLanguages", "Afro-asiatic languages"} <= set(by["Afroasiatic languages"]["aliases"])
    assert "AbacuS" in by["Abacus"]["aliases"]
    # infobox fields became attributes, keeping their source field
    autism = {a["key"]: a for a in by["Autism"]["attributes"]}
    assert autism["field"]["value"] == "Psychiatry" and autism["field"]["source"].startswith("| field =")
    assert any(i.endswith(".jpg") for i in by["Autism"]["images"])
    # links resolve through redirects; namespaced links are not edges
    probe = by["Osvl probe"]["id"]
    targets = {ents[d]["title"] for s, d, _ in links if s == probe}
    assert targets == {"Afroasiatic languages", "Abacus"}


def test_mediawiki_page_parse_is_pure(shared_data: Path) -> None:
    pages = [p for p in mediawiki.iter_pages(shared_data / MW_SAMPLE) if p.title == "Autism"]
    a, b = mediawiki.parse_page(pages[0]), mediawiki.parse_page(pages[0])
    assert a == b and a["kind"] == "article" and "Psychiatry" in {x["value"] for x in a["attributes"]}
    # the lead's first link, an infobox field's link under its field name, and the body's links (292 in all)
    assert a["links"][:2] == [("Autism spectrum", "linked_to"), ("Pervasive developmental disorder", "linked_to")]
    assert ("Psychiatry", "field") in a["links"] and len(a["links"]) > 250


class _Repeat(io.RawIOBase):
    """The export's pages repeated n times in one stream, generated lazily (never all in memory)."""

    def __init__(self, xml: bytes, n: int) -> None:
        head, rest = xml.split(b"<page>", 1)
        body, tail = rest.rsplit(b"</mediawiki>", 1)
        self.parts = iter([head] + [b"<page>" + body] * n + [b"</mediawiki>" + tail])
        self.buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while len(self.buf) < len(b):
            nxt = next(self.parts, None)
            if nxt is None:
                break
            self.buf += nxt
        n = min(len(b), len(self.buf))
        b[:n], self.buf = self.buf[:n], self.buf[n:]
        return n


def _rss_mb() -> float:
    fields = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", fields).group(1)) / 1024


@pytest.mark.slow
def test_mediawiki_stream_memory_is_flat(shared_data: Path) -> None:
    xml = bz2.decompress((shared_data / MW_SAMPLE).read_bytes())
    before = _rss_mb()
    pages = rows = 0
    for page in mediawiki.iter_pages(io.BufferedReader(_Repeat(xml, 50), buffer_size=1 << 20)):
        pages += 1
        if pages % 5 == 0:  # parse_page is pure; a fifth of the pages keeps the test near a minute
            rows += bool(mediawiki.parse_page(page)["title"])
    grown = _rss_mb() - before
    assert pages == 206 * 50 and rows == pages // 5
    assert grown < 200, f"memory grew by {grown:.0f} MB over 50 repetitions"


# ---------------------------------------------------------------- the committed sample


def test_sample_has_every_wikispeedia_entity_and_link(shared_data: Path, kg) -> None:
    ws = [r[0] for r in wikispeedia.read_tsv(shared_data / "wikispeedia" / "articles.tsv")]
    titles = {wikispeedia.title_from_url(t) for t in ws}
    origin = {e["title"]: e["origin"] for e in kg.entities.values()}
    assert all(origin.get(t) == "wikispeedia" for t in titles)
    pairs = {(wikispeedia.title_from_url(a), wikispeedia.title_from_url(b))
             for a, b in wikispeedia.read_tsv(shared_data / "wikispeedia" / "links.tsv") if a != b}  # no self-loops
    have = {(kg.entities[s]["title"], kg.entities[d]["title"]) for s, outs in kg.out_links.items() for d, _ in outs}
    assert pairs <= have
    assert sum(e["origin"] == "wikidata" for e in kg.entities.values()) > 7000
    eiffel = kg.entities[kg.find("Eiffel Tower")[0]]
    assert eiffel["origin"] == "wikidata" and eiffel["description"]
    assert fold("Paris") in {fold(kg.entities[d]["title"]) for d, _ in kg.neighbors(eiffel["id"])}


def test_sample_shape_for_walks(kg) -> None:
    indeg = sorted(e["in_degree"] for e in kg.entities.values() if e["in_degree"])
    p99 = indeg[int(0.99 * (len(indeg) - 1))]
    assert 150 <= p99 <= 450
    kinds = {e["kind"] for e in kg.entities.values()}
    assert {"article", "list", "index", "disambiguation"} <= kinds
    n = len(kg)
    holders: dict[str, set[int]] = {}
    for e in kg.entities.values():
        for a in e["attributes"]:
            holders.setdefault(fold(a["value"]), set()).add(e["id"])
    for e in kg.entities.values():
        for a in e["attributes"]:
            if a["eligible"]:
                # words are alphanumeric tokens (a dash between dates is not one)
                assert len(fold(a["value"]).split()) <= 6 and len(holders[fold(a["value"])]) <= 0.01 * n


def _reachable_eligible(kg, start: int) -> bool:
    """An eligible attribute 2-4 hops away, through article entities only."""
    seen, queue = {start}, deque([(start, 0)])
    while queue:
        node, depth = queue.popleft()
        if 2 <= depth <= 4 and any(a["eligible"] for a in kg.entities[node]["attributes"]):
            return True
        if depth < 4:
            for nxt, _ in kg.neighbors(node):
                if nxt not in seen and kg.entities[nxt]["kind"] == "article":
                    seen.add(nxt)
                    queue.append((nxt, depth + 1))
    return False


def test_sample_grounded_seeds(kg) -> None:
    seeds = [e for e in kg.anchors if _reachable_eligible(kg, e)]
    assert len(seeds) >= 30
    for eid, rows in kg.anchors.items():
        for a in rows:
            assert kg.image_path(a["image"]).is_file() and a["image"] in kg.entities[eid]["images"]
            assert a["licence"] and a["scorer"] and a["score"] > 0
    assert not any("world_music" in a["source"] for rows in kg.anchors.values() for a in rows)


def test_sample_files_sizes_and_attribution() -> None:
    from PIL import Image

    files = [p for p in SAMPLE_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 25 * 2**20
    assert max(p.stat().st_size for p in files) < 5 * 10**6
    attribution = (SAMPLE_DIR / "ATTRIBUTION.md").read_text()
    for p in (SAMPLE_DIR / "images").iterdir():
        assert f"`images/{p.name}`" in attribution
        with Image.open(p) as im:
            assert max(im.size) <= 512
