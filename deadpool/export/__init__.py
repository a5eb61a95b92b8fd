"""``python -m deadpool.export RUN_DIR_OR_CHECKPOINT OUT_DIR``: a trained model in the Hugging Face
LLaMA format.

    consolidate.py     the tp/pp shards of a run's ``final/`` or a checkpoint -> whole
                       parameters, one at a time
    llama.py           DeadPool names and q/k layout -> ``LlamaForCausalLM``'s; config.json
    safetensors_io.py  safetensors files written tensor by tensor (memory: the largest tensor)
    hf_import.py       the other way: ``model.init_from=HF_DIR``, each rank reading its slices
    sample.py          ``python -m deadpool.export.sample OUT "prompt"``: transformers continues it

Imports run one way: this package may import the model, the stage builder and the checkpoint
reader; the trainer and ``job.validate`` import ``hf_import`` (nothing here imports them).

``OUT_DIR`` receives ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` files and
``model.safetensors.index.json`` past ``--max-shard-size``), ``config.json``, and, when the run
trained on ``data=tokens``, its ``tokenizer.json`` with a ``tokenizer_config.json``. Then::

    model = transformers.LlamaForCausalLM.from_pretrained(OUT_DIR)
    tokenizer = transformers.AutoTokenizer.from_pretrained(OUT_DIR)

Tensors keep the dtype the run stored its parameters in; ``--dtype bfloat16`` (or float16,
float32) converts them, except that ``--dtype float32`` of a mixed-precision run exports its
fp32 master weights (``master``, ZeRO-1 shards joined), not its bf16 parameters upcast.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from deadpool.export.consolidate import ExportError, iter_full_parameters, load_source, stage_flat
from deadpool.export.llama import hf_config, to_hf
from deadpool.export.safetensors_io import INDEX, write_stream
from deadpool.model import GPT, model_config

__all__ = ["ExportError", "export", "parse_size"]


def parse_size(text: str) -> int:
    """``"5GB"``, ``"200MB"``, ``"4096"`` -> bytes (decimal units, as Hugging Face's)."""
    t = str(text).strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if t.endswith(unit):
            return int(float(t[:-len(unit)]) * mult)
    return int(t)


def copy_tokenizer(cfg: dict, out: Path, log) -> tuple[int, int] | None:
    """The run's tokenizer (data=tokens), if its prepared directory is still there; returns the
    end-of-document and beginning-of-document ids (the same id when it has no BOS of its own)."""
    data = cfg.get("data") or {}
    if data.get("name") != "tokens":
        return None
    src = Path(data["path"])
    try:
        manifest = json.loads((src / "manifest.json").read_text())
    except OSError:
        log(f"[export] warning: the run's data.path {src} is gone: no tokenizer written")
        return None
    # the prepared file is the user's own tokenizer.json byte for byte (prepare --tokenizer PATH),
    # its special tokens named as prepare found them (older manifests: prepare's <|endoftext|>)
    tk = manifest["tokenizer"]
    shutil.copyfile(src / tk["file"], out / "tokenizer.json")
    eos = tk.get("eos_token") or "<|endoftext|>"
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
        "bos_token": tk.get("bos_token") or eos, "model_max_length": int(cfg["model"]["max_seq_len"]),
        "clean_up_tokenization_spaces": False}, indent=1))
    eos_id = int(manifest["eos_id"])
    bos_id = eos_id
    if tk.get("bos_token"):  # its own BOS (a Llama 3 tokenizer's <|begin_of_text|>), by id
        from tokenizers import Tokenizer

        found = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(tk["bos_token"])
        bos_id = eos_id if found is None else int(found)
    return eos_id, bos_id


def export(src, out, *, dtype: str | None = None, max_shard_size: str = "5GB",
           job=None, log=print) -> dict:
    """Write ``out`` (module docstring) from a run directory or checkpoint; returns config.json.
    Tensor by tensor: one full parameter is held at a time (``iter_full_parameters``), converted
    and written (``safetensors_io.write_stream``) before the next is assembled."""
    cfg, dims, states, what = load_source(src, job)
    mcfg = cfg["model"]
    masters = dtype == "float32" and all("master" in st for st in states.values())
    source = "master" if masters else "params"
    if dtype is not None:
        try:
            target = getattr(torch, dtype)
        except AttributeError:
            raise ExportError(f"--dtype {dtype}: not a torch dtype (float32, bfloat16, float16)") from None
    else:
        target = stage_flat(dims, states, 0, 0, source)[0].dtype
    with torch.device("meta"):  # names, shapes (and so the files' headers) before any data
        meta = {n: p.detach() for n, p in GPT(model_config(mcfg)).named_parameters()}
    plan = [(n, tuple(t.shape), target) for n, t in to_hf(meta, mcfg).items()]
    tensors = ((hf_name, t.to(target))
               for name, full in iter_full_parameters(mcfg, dims, states, source)
               for hf_name, t in to_hf({name: full}, mcfg).items())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = copy_tokenizer(cfg, out, log)
    config = hf_config(mcfg, target, *(ids or (None, None)))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    files = write_stream(plan, tensors, out, parse_size(max_shard_size))
    n = sum(math.prod(shape) for _, shape, _ in plan)
    log(f"[export] {what} (dp{dims.dp} x tp{dims.tp} x pp{dims.pp}) -> {out}: {n:,} parameters, "
        f"{str(target).removeprefix('torch.')}{' (fp32 master weights)' if masters else ''}, "
        f"{len(files)} safetensors file(s)")
    return config
