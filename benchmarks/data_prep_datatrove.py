"""The reference pipeline for benchmarks/data_prep_bench.py, in datatrove (run by the benchmark
venv's python, which has datatrove and spaCy; this project's venv need not have either).

The same steps as tasks.data.prep, with datatrove's blocks at their defaults: Gopher repetition,
Gopher quality, C4 quality, FineWeb quality, PII (emails and public IPv4), MinHash dedup
(5-grams, 14 x 8, its four stages: signatures, buckets, clusters, filter), documents written
to Parquet, tokenization with the given tokenizer.json and EOS, and the token files merged.
Differences the numbers should be read with: datatrove has no NFC/whitespace normalizer, no
separate exact-dedup pass (MinHash also removes exact copies), and its PII step redacts fewer kinds.

    python data_prep_datatrove.py --corpus DIR --work DIR --workers N --tokenizer tokenizer.json
Prints one JSON object: seconds per stage and in total, and where the outputs are.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--tokenizer", required=True)
    args = parser.parse_args()

    from loguru import logger

    logger.remove()  # datatrove logs every step at INFO; the timings are what we want to see
    logging.disable(logging.WARNING)

    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                          MinhashDedupFilter, MinhashDedupSignature)
    from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter, GopherQualityFilter,
                                            GopherRepetitionFilter)
    from datatrove.pipeline.formatters import PIIFormatter
    from datatrove.pipeline.readers import JsonlReader, ParquetReader
    from datatrove.pipeline.tokens import DocumentTokenizer, DocumentTokenizerMerger
    from datatrove.pipeline.writers import ParquetWriter

    work = Path(args.work)
    files = sorted(Path(args.corpus).glob("*.jsonl"))
    tasks, workers = len(files), args.workers
    minhash = MinhashConfig()  # 5-grams, 14 buckets x 8 hashes, the FineWeb settings

    def run(name: str, pipeline: list, n_tasks: int) -> float:
        started = time.perf_counter()
        LocalPipelineExecutor(pipeline, tasks=n_tasks, workers=min(workers, n_tasks),
                              logging_dir=str(work / "logs" / name)).run()
        return round(time.perf_counter() - started, 3)

    seconds = {
        "filters_and_signatures": run("filter", [
            JsonlReader(args.corpus, glob_pattern="*.jsonl", text_key="text", id_key="id"),
            GopherRepetitionFilter(),
            GopherQualityFilter(),
            C4QualityFilter(),
            FineWebQualityFilter(),
            PIIFormatter(),
            ParquetWriter(str(work / "filtered"), output_filename="${rank}.parquet"),
            MinhashDedupSignature(output_folder=str(work / "signatures"), config=minhash),
        ], tasks),
        "buckets": run("buckets", [
            MinhashDedupBuckets(input_folder=str(work / "signatures"), output_folder=str(work / "buckets"),
                                config=minhash),
        ], minhash.num_buckets),
        "clusters": run("clusters", [
            MinhashDedupCluster(input_folder=str(work / "buckets"), output_folder=str(work / "remove_ids"),
                                config=minhash),
        ], 1),
        "dedup_documents_tokens": run("tokenize", [
            ParquetReader(str(work / "filtered")),
            MinhashDedupFilter(input_folder=str(work / "remove_ids")),
            ParquetWriter(str(work / "documents"), output_filename="${rank}.parquet"),
            DocumentTokenizer(output_folder=str(work / "tokenized"), tokenizer_name_or_path=args.tokenizer,
                              eos_token="<|endoftext|>", local_working_dir=str(work / "tok_tmp")),
        ], tasks),
        "merge": run("merge", [
            DocumentTokenizerMerger(input_folder=str(work / "tokenized"), output_folder=str(work / "merged"),
                                    save_filename="corpus", progress=False),
        ], 1),
    }
    print(json.dumps({"seconds": seconds, "total_seconds": round(sum(seconds.values()), 3),
                      "filtered": str(work / "filtered"), "documents": str(work / "documents"),
                      "merged": str(work / "merged")}))


if __name__ == "__main__":
    main()
