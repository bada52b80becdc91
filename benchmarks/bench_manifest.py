"""Reading and sampling a million-record dataset manifest (issue 30).

Writes a manifest of ``--rows`` records (text tokens, image counts 0-3, pixel sizes from thumbnails to
full HD, seeded) as CSV, Parquet and JSONL into a temporary folder, then times, for each format, what
``mpipe-tune plan --workload manifest`` does before its search: read the table, resize every image
with Qwen2-VL's rule (vectorised), and draw the sampled steps (4 steps of 4096 sequences, packed to
8192 tokens). Target: under 30 s for 1,000,000 rows.

    python benchmarks/bench_manifest.py                 # 1,000,000 rows, a Markdown table
    python benchmarks/bench_manifest.py --rows 100000 --json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from mpipe_tune.inputs import read_dataset, DatasetSpec, ImageRule, TextRule


def make_manifest(rows: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    counts = rng.choice([0, 1, 2, 3], size=rows, p=[0.3, 0.5, 0.15, 0.05])
    width = rng.integers(112, 1921, size=rows)
    height = np.clip((width * rng.uniform(0.5, 1.5, size=rows)).astype(np.int64), 112, 2160)
    return pd.DataFrame({"text_tokens": rng.integers(16, 2048, size=rows), "num_images": counts,
                         "image_width": np.where(counts > 0, width, 0), "image_height": np.where(counts > 0, height, 0)})


def time_format(table: pd.DataFrame, folder: Path, suffix: str, steps: int, sequences: int) -> dict:
    path = folder / f"manifest{suffix}"
    {".csv": lambda: table.to_csv(path, index=False), ".parquet": lambda: table.to_parquet(path),
     ".jsonl": lambda: table.to_json(path, orient="records", lines=True)}[suffix]()
    spec = DatasetSpec(str(path), ImageRule.dynamic(), TextRule(), seq_len=8192)
    started = time.perf_counter()
    dataset = read_dataset(spec, progress=False)
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    for step in range(steps):
        dataset.sequences(sequences, step)
    sample_s = time.perf_counter() - started
    return {"format": suffix[1:], "rows": len(dataset.records), "images": int(len(dataset.records.image_tokens)),
            "file_mb": path.stat().st_size / 1e6, "read_s": read_s, "sample_s": sample_s,
            "total_s": read_s + sample_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=4096)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    table = make_manifest(args.rows)
    with tempfile.TemporaryDirectory() as folder:
        results = [time_format(table, Path(folder), suffix, args.steps, args.sequences) for suffix in (".csv", ".parquet", ".jsonl")]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.rows} rows, {args.steps} steps of {args.sequences} sequences packed to 8192 tokens; "
          f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, pandas {pd.__version__}")
    print("| format | file MB | images | read s | sample s | total s |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['format']} | {r['file_mb']:.1f} | {r['images']} | {r['read_s']:.2f} | {r['sample_s']:.2f} | "
              f"{r['total_s']:.2f} |")


if __name__ == "__main__":
    main()
