"""The retrieve stage's vector index: a folder of text documents cut into passages, embedded by a model of the
deployment, searched by inner product of normalized vectors (cosine) in a faiss index kept on disk. The index is
rebuilt only when the documents, the cutting or the embedding model change (a fingerprint of them is stored
beside it)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np

logger = logging.getLogger("rivulet.server")

DOC_SUFFIXES = (".txt", ".md", ".rst")
INDEX_FILE, META_FILE = "index.faiss", "passages.json"


def split_passages(text: str, chunk_chars: int) -> list[str]:
    """Paragraphs (blank-line separated) packed into passages of at most `chunk_chars` characters; a longer
    paragraph is cut at whitespace."""
    passages: list[str] = []
    current = ""
    for para in (p.strip() for p in text.split("\n\n")):
        if not para:
            continue
        while len(para) > chunk_chars:
            cut = para.rfind(" ", 0, chunk_chars)
            cut = cut if cut > 0 else chunk_chars
            passages.append(para[:cut].strip())
            para = para[cut:].strip()
        if current and len(current) + 2 + len(para) > chunk_chars:
            passages.append(current)
            current = ""
        current = f"{current}\n\n{para}" if current else para
    if current:
        passages.append(current)
    return passages


def read_documents(folder: str, chunk_chars: int) -> tuple[list[str], list[str], str]:
    """(passages, the file each comes from, a fingerprint of the files and the cutting)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ValueError(f"retrieve: the documents folder {folder} does not exist")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in DOC_SUFFIXES)
    if not files:
        raise ValueError(f"retrieve: {folder} has no {', '.join(DOC_SUFFIXES)} documents")
    h = hashlib.sha256(f"chunk={chunk_chars}".encode())
    passages, sources = [], []
    for f in files:
        data = f.read_bytes()
        h.update(str(f.relative_to(root)).encode() + b"\0" + hashlib.sha256(data).digest())
        for p in split_passages(data.decode("utf-8", errors="replace"), chunk_chars):
            passages.append(p)
            sources.append(str(f.relative_to(root)))
    return passages, sources, h.hexdigest()


class DocumentIndex:
    def __init__(self, index: Any, passages: list[str], sources: list[str]) -> None:
        self.index, self.passages, self.sources = index, passages, sources

    @classmethod
    async def open(cls, documents: str, index_dir: str, chunk_chars: int, model_key: str,
                   embed: Callable[[list[str]], Awaitable[list[list[float]]]]) -> DocumentIndex:
        """The index of `documents` from `index_dir` if it is current, else built (and saved there)."""
        faiss = _faiss()
        passages, sources, fingerprint = read_documents(documents, chunk_chars)
        fingerprint = hashlib.sha256(f"{fingerprint}|{model_key}".encode()).hexdigest()
        out = Path(index_dir).expanduser()
        meta_path, index_path = out / META_FILE, out / INDEX_FILE
        if meta_path.is_file() and index_path.is_file():
            try:
                meta = json.loads(meta_path.read_text())
                if meta.get("fingerprint") == fingerprint:
                    logger.info("retrieve: loaded the index of %d passages from %s", len(passages), out)
                    return cls(faiss.read_index(str(index_path)), meta["passages"], meta["sources"])
            except (OSError, ValueError, RuntimeError, KeyError) as e:
                logger.warning("retrieve: the saved index in %s is unusable (%s); rebuilding it", out, e)
        vectors = np.asarray(await embed(passages), dtype=np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True).clip(min=1e-12)
        index = faiss.IndexFlatIP(vectors.shape[1])
        index.add(vectors)
        out.mkdir(parents=True, exist_ok=True)
        tmp = index_path.with_suffix(".tmp")
        faiss.write_index(index, str(tmp))
        os.replace(tmp, index_path)
        meta_tmp = meta_path.with_suffix(".tmp")
        meta_tmp.write_text(json.dumps({"fingerprint": fingerprint, "model": model_key, "passages": passages,
                                        "sources": sources}))
        os.replace(meta_tmp, meta_path)  # written last: an index without it is rebuilt
        logger.info("retrieve: indexed %d passages of %s into %s", len(passages), documents, out)
        return cls(index, passages, sources)

    def search(self, vector: list[float], k: int) -> list[str]:
        q = np.asarray([vector], dtype=np.float32)
        q /= max(float(np.linalg.norm(q)), 1e-12)
        _, ids = self.index.search(q, min(k, len(self.passages)))
        return [self.passages[i] for i in ids[0] if i >= 0]


def _faiss() -> Any:
    try:
        import faiss
    except ImportError:
        raise ValueError("the retrieve stage needs faiss: pip install faiss-cpu==1.15.1 "
                         "(or rivulet[retrieval])") from None
    return faiss
