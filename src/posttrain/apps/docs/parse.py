"""Parsing documents into pages and sections: PDF (pdfplumber, one block per page, ruled tables kept as
`| a | b | c |` rows in reading order), HTML (headings become sections, tables become `a | b | c` rows), Markdown and plain text; and chunking a parsed document into
pieces of at most N tokens, each knowing its page and section (the citations of map-reduce).

Every failure is a `ParseError` naming the problem (empty, too large, corrupt PDF, binary data).
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any

DEFAULT_MAX_BYTES = 20 * 1024 * 1024


class ParseError(ValueError):
    """The document cannot be read; the message says why."""


@dataclass
class Block:
    text: str
    page: int | None
    section: str | None


@dataclass
class ParsedDoc:
    kind: str  # "pdf" | "html" | "markdown" | "text"
    blocks: list[Block] = field(default_factory=list)
    n_pages: int = 0

    @property
    def text(self) -> str:
        return "\n\n".join(b.text for b in self.blocks)


_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*$")


def _markdown_blocks(text: str, page: int | None = None, section: str | None = None) -> list[Block]:
    """Paragraph blocks (blank-line separated), each tagged with the latest heading above it."""
    blocks: list[Block] = []
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        m = _HEADING.match(para.splitlines()[0])
        if m:
            section = m.group(2)
        blocks.append(Block(para, page, section))
    return blocks


class _HTMLText(HTMLParser):
    SKIP = {"script", "style", "head"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in self.SKIP:
            self.skip += 1
        elif re.fullmatch(r"h[1-6]", tag):
            self.out.append("\n\n" + "#" * int(tag[1]) + " ")
        elif tag in ("p", "div", "table", "ul", "ol", "section", "article"):
            self.out.append("\n\n")
        elif tag in ("tr", "br", "li"):
            self.out.append("\n")
        elif tag in ("td", "th"):
            self.out.append("| ")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag in ("td", "th"):
            self.out.append(" ")
        elif re.fullmatch(r"h[1-6]", tag) or tag in ("p", "table"):
            self.out.append("\n\n")

    def handle_data(self, data: str) -> None:
        if not self.skip:
            self.out.append(re.sub(r"\s+", " ", data))


def parse_document(data: bytes, name: str, max_bytes: int = DEFAULT_MAX_BYTES) -> ParsedDoc:
    """Parse one object's bytes; the kind comes from the content (PDF magic) and then the file name."""
    if len(data) == 0:
        raise ParseError("empty document (0 bytes)")
    if len(data) > max_bytes:
        raise ParseError(f"document is {len(data):,} bytes, over the limit of {max_bytes:,} (--max-bytes)")
    lower = name.lower()
    if data[:5] == b"%PDF-" or lower.endswith(".pdf"):
        return _parse_pdf(data)
    if b"\x00" in data[:8192]:
        raise ParseError("binary data that is not a PDF (a NUL byte in the first 8 KiB)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ParseError(f"not UTF-8 text: {err}") from None
    if lower.endswith((".html", ".htm")) or text.lstrip()[:15].lower().startswith(
        ("<!doctype html", "<html")
    ):
        p = _HTMLText()
        p.feed(text)
        md = re.sub(r"\n{3,}", "\n\n", "".join(p.out))
        doc = ParsedDoc("html", _markdown_blocks(md), 1)
    elif lower.endswith((".md", ".markdown")):
        doc = ParsedDoc("markdown", _markdown_blocks(text), 1)
    else:
        doc = ParsedDoc("text", _markdown_blocks(text), 1)
    if not doc.blocks:
        raise ParseError(f"{doc.kind} document holds no text")
    return doc


def _table_rows(rows: list[list[str | None]]) -> str:
    """A table as `| a | b |` rows (cells on one line each), as HTML tables are rendered."""
    return "\n".join(
        "| " + " | ".join(re.sub(r"\s+", " ", c or "").strip() for c in row) + " |" for row in rows
    )


def _pdf_page_text(page: Any) -> str:
    """The page's text lines and its ruled tables, in reading order (top to bottom)."""
    tables = page.find_tables()
    boxes = [t.bbox for t in tables]

    def outside(obj: dict[str, Any]) -> bool:
        x, top = (obj.get("x0", 0) + obj.get("x1", 0)) / 2, (obj.get("top", 0) + obj.get("bottom", 0)) / 2
        return not any(b[0] <= x <= b[2] and b[1] <= top <= b[3] for b in boxes)

    items = [(ln["top"], ln["text"]) for ln in page.filter(outside).extract_text_lines()]
    items += [(t.bbox[1], _table_rows(t.extract())) for t in tables]
    return "\n".join(text for _, text in sorted(items, key=lambda it: it[0]))


def _parse_pdf(data: bytes) -> ParsedDoc:
    import pdfplumber

    try:
        with pdfplumber.open(io.BytesIO(data)) as pdf:
            pages = [_pdf_page_text(p) for p in pdf.pages]
    except Exception as err:  # noqa: BLE001 - pdfminer raises many types on damaged files
        raise ParseError(f"corrupt PDF: {type(err).__name__}: {err}") from None
    blocks: list[Block] = []
    for i, text in enumerate(pages, start=1):
        text = re.sub(r"\n?Page \d+\s*$", "", text.strip())  # the footer
        if text:
            blocks.append(Block(text, i, None))
    if not blocks:
        raise ParseError(f"PDF with {len(pages)} page(s) holds no extractable text (a scan?)")
    return ParsedDoc("pdf", blocks, len(pages))


@dataclass
class Chunk:
    text: str
    pages: list[int]
    sections: list[str]
    blocks: list[Block] = field(default_factory=list)


def chunk_blocks(blocks: list[Block], max_tokens: int, count_tokens: Any) -> list[Chunk]:
    """Greedy packing of consecutive blocks into chunks of at most `max_tokens` tokens; a block longer
    than that is split on lines (then hard-cut) so no chunk exceeds the budget."""
    pieces: list[Block] = []
    for b in blocks:
        if count_tokens(b.text) <= max_tokens:
            pieces.append(b)
            continue
        cur = ""
        for line in b.text.splitlines():
            while count_tokens(line) > max_tokens:  # a single enormous line
                cut = max(1, len(line) * max_tokens // (2 * count_tokens(line)))
                pieces.append(Block(line[:cut], b.page, b.section))
                line = line[cut:]
            if cur and count_tokens(cur + "\n" + line) > max_tokens:
                pieces.append(Block(cur, b.page, b.section))
                cur = line
            else:
                cur = f"{cur}\n{line}" if cur else line
        if cur:
            pieces.append(Block(cur, b.page, b.section))
    chunks: list[Chunk] = []
    cur_blocks: list[Block] = []
    cur_tokens = 0
    for p in pieces:
        n = count_tokens(p.text) + 2
        if cur_blocks and cur_tokens + n > max_tokens:
            chunks.append(_chunk(cur_blocks))
            cur_blocks, cur_tokens = [], 0
        cur_blocks.append(p)
        cur_tokens += n
    if cur_blocks:
        chunks.append(_chunk(cur_blocks))
    return chunks


def _chunk(blocks: list[Block]) -> Chunk:
    pages = sorted({b.page for b in blocks if b.page is not None})
    sections = list(dict.fromkeys(b.section for b in blocks if b.section))
    return Chunk("\n\n".join(b.text for b in blocks), pages, sections, list(blocks))
