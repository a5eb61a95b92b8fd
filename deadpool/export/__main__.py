"""``python -m deadpool.export RUN_DIR_OR_CHECKPOINT OUT_DIR`` (see ``deadpool.export``)."""

from __future__ import annotations

import argparse
import sys
import time

from deadpool.export import ExportError, export


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deadpool.export",
                                 description="Export a DeadPool run or checkpoint as a Hugging "
                                             "Face LlamaForCausalLM (safetensors + config.json).")
    ap.add_argument("src", help="a run directory (its final/) or a checkpoint directory "
                                "(a step_<S> directory, or a root holding them: the newest)")
    ap.add_argument("out", help="directory to write")
    ap.add_argument("--dtype", default=None, help="convert tensors (float32, bfloat16, float16); "
                                                  "default: as stored")
    ap.add_argument("--max-shard-size", default="5GB", help="split safetensors files past this")
    ap.add_argument("--job", default=None, help="the run's job.json, if not in SRC or above it")
    ap.add_argument("--sample", default=None, metavar="PROMPT",
                    help="then load OUT with transformers and print a greedy continuation of "
                         "PROMPT (deadpool.export.sample)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="with --sample")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        export(a.src, a.out, dtype=a.dtype, max_shard_size=a.max_shard_size, job=a.job)
    except ExportError as e:
        print(f"[export] error: {e}", file=sys.stderr)
        return 2
    print(f"[export] done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if a.sample is not None:
        from deadpool.export import sample

        return sample.main([a.out, a.sample, "--max-new-tokens", str(a.max_new_tokens)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
