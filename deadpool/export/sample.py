"""``python -m deadpool.export.sample HF_DIR "prompt"``: an exported model, loaded by transformers,
continues a prompt (greedy), so a user sees it work outside DeadPool.

The prompt is encoded with the directory's ``tokenizer.json`` (exported with a ``data=tokens``
run); without one, ``--ids 1,2,3`` gives token ids and the continuation is printed as ids.
``python -m deadpool.export SRC OUT --sample "prompt"`` runs this on ``OUT`` after exporting.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def continuation(model_dir, prompt: str | None = None, ids: list[int] | None = None,
                 max_new_tokens: int = 32) -> tuple[list[int], str | None]:
    """(new token ids, the prompt and continuation as text or None without a tokenizer),
    greedy, by transformers."""
    import transformers

    model_dir = Path(model_dir)
    tok = None
    if (model_dir / "tokenizer.json").exists():
        tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    if ids is None:
        if tok is None:
            raise ValueError(f"{model_dir} has no tokenizer.json: give token ids (--ids 1,2,3)")
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
    model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    x = torch.tensor([ids])
    eos = model.config.eos_token_id
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=eos if eos is not None else 0)
    new = out[0, x.shape[1]:].tolist()
    return new, (tok.decode(ids + new) if tok is not None else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deadpool.export.sample",
                                 description="Greedy continuation of a prompt by an exported model "
                                             "(transformers.LlamaForCausalLM).")
    ap.add_argument("model_dir", help="an export's directory (config.json, safetensors)")
    ap.add_argument("prompt", nargs="?", default=None, help="text (needs the export's tokenizer.json)")
    ap.add_argument("--ids", default=None, help="comma-separated token ids instead of a prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    a = ap.parse_args(argv)
    ids = [int(i) for i in a.ids.split(",")] if a.ids else None
    if ids is None and a.prompt is None:
        ap.error("give a prompt or --ids")
    try:
        new, text = continuation(a.model_dir, a.prompt, ids, a.max_new_tokens)
    except (ValueError, OSError) as e:
        print(f"[sample] error: {e}", file=sys.stderr)
        return 2
    print(text if text is not None else " ".join(map(str, new)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
